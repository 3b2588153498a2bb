"""The runtime half of pp-core: stages, point-to-point communication, the executor."""

from pp_core.runtime.initializers import (
    PipelineRuntimeInitializer,
    collect_pipeline_runtime_initializers,
)

__all__ = ["PipelineRuntimeInitializer", "collect_pipeline_runtime_initializers"]
