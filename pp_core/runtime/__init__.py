"""The runtime half of pp-core: stages, point-to-point communication, the executor."""

from pp_core.lazy import lazy_face

from pp_core.runtime.initializers import (
    PipelineRuntimeInitializer,
    collect_pipeline_runtime_initializers,
)

__all__ = ["PipelineRuntimeInitializer", "collect_pipeline_runtime_initializers", "Pipeline",
           "build_pipeline"]

# Lazy: importing pp_core.runtime (the plugin manager does) must not import torch.distributed.
__getattr__, __dir__ = lazy_face(__name__, {"Pipeline": ".pipeline", "build_pipeline": ".build"})
