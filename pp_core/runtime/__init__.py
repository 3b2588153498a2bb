"""The runtime half of pp-core: stages, point-to-point communication, the executor."""

from pp_core.runtime.initializers import (
    PipelineRuntimeInitializer,
    collect_pipeline_runtime_initializers,
)

__all__ = ["PipelineRuntimeInitializer", "collect_pipeline_runtime_initializers", "Pipeline",
           "build_pipeline"]


def __getattr__(name):
    # Lazy: importing pp_core.runtime (the plugin manager does) must not import torch.distributed.
    if name in ("Pipeline", "build_pipeline"):
        from pp_core.runtime import pipeline  # lazy: torch.distributed, see above

        return getattr(pipeline, name)
    raise AttributeError(f"module 'pp_core.runtime' has no attribute {name!r}")
