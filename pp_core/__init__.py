"""pp-core: pipeline-parallel training for PyTorch, built as a pluggy plugin framework.

The schedule half (``pp_core.schedule``) is pure Python; the runtime half (``pp_core.runtime``)
imports torch.distributed only when a pipeline is built.
"""

from pp_core.config import PipelineConfig
from pp_core.errors import ConfigError, PipelineError, PluginError, PPCoreError, ScheduleError
from pp_core.errors import ScheduleFileNotFoundError
from pp_core.hookspecs import hookimpl
from pp_core.schedule.ir import (
    B,
    F,
    I,
    W,
    Action,
    ActionKind,
    Schedule,
    ScheduleDef,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "hookimpl",
    "PipelineConfig",
    "build_pipeline",
    "plan_auto",
    "Action",
    "ActionKind",
    "F",
    "B",
    "I",
    "W",
    "Schedule",
    "ScheduleDef",
    "PPCoreError",
    "PluginError",
    "ScheduleError",
    "ScheduleFileNotFoundError",
    "ConfigError",
    "PipelineError",
    "current_seq_slice",
]


def current_seq_slice():
    """The sequence slice whose forward runs now (``pipeline.pp_seq_chunks > 1``), else ``None``:
    a model's attention takes the earlier slices' keys and values from it
    (:class:`pp_core.runtime.seq_slices.SeqSlice`). A model that does so says
    ``pp_seq_slices = True`` on its class; others are refused with slices."""
    from pp_core.runtime.seq_slices import current_seq_slice as current  # lazy: imports torch

    return current()


def build_pipeline(model, config, pp_group=None, device="cpu", **options):
    """Split ``model`` into this rank's stages and return a :class:`pp_core.runtime.Pipeline`.

    :param pp_group: a ProcessGroup or a 1-D DeviceMesh of the pipeline ranks; ``None``: the
        default group (a single-process pipeline when torch.distributed is not initialised).
    :param device: where this rank's parts and tensors live (``"cuda:0"``, ``"cpu"``).

    Every option (keyword-only, as :func:`pp_core.runtime.build.build_pipeline` takes them):

    * ``meshes=``: every mesh and group of the run, ``ParallelDims(...).build(device_type)``
      (the pp group when ``pp_group`` is None; a token-normalised loss counts the step's valid
      tokens over ``meshes.loss_group``; ``step`` finishes TP's and EP's gradients); apply the
      parallelisms with ``pp_core.parallel.parallelize(pipe, meshes, settings)``;
    * ``plugins=``: a :class:`pp_core.plugin_manager.Plugins`; default the installed plugins;
    * ``timeout=``: seconds a single wait may take before the step fails;
    * ``splitter=``: a splitter name or object (``BalancedSplitter(profile)``); None: automatic.

    Imported lazily so that ``import pp_core`` stays light (no torch.distributed).
    """
    from pp_core.runtime.build import build_pipeline as _build  # lazy: torch

    return _build(model, config, pp_group=pp_group, device=device, **options)


def plan_auto(model, config, inputs, target, pp_size, **options):
    """Profile ``model``, choose the fastest plan that fits memory, return an ``AutoPlan`` whose
    ``config`` is a concrete :class:`PipelineConfig` for :func:`build_pipeline`.

    ``options`` are those of :func:`pp_core.measure.plan_auto.plan_auto` (``memory_cap=``,
    ``group=``, ``device=``, ...). Imported lazily, like :func:`build_pipeline`.
    """
    from pp_core.measure.plan_auto import plan_auto as _plan  # lazy: torch, off `import pp_core`

    return _plan(model, config, inputs, target, pp_size, **options)
