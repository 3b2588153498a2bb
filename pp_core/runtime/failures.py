"""How a failed step ends: on this rank, and - through the process group's store - on every other.

Whatever goes wrong during a step (an exception in a stage, a loss, a plugin; a peer that failed
or vanished) ends it with one :class:`~pp_core.PipelineError` naming the rank, stage, action and
cause. This rank drops the step's tensors and pending operations, tells its dp peers and its
pipeline peers (:meth:`~pp_core.runtime.p2p.P2P.publish_and_abort`), and logs the error
(logger ``pp_core.runtime.failures``), so a failure reaches the logs even when the caller
swallows the exception.
"""

from __future__ import annotations

import logging
import traceback
from typing import NoReturn

from pp_core.errors import PipelineError
from pp_core.runtime.p2p import PeerFailure

__all__ = ["end_failed_step", "forget_frames"]

logger = logging.getLogger(__name__)


def end_failed_step(executor, p2p, rank: int, exc: Exception) -> NoReturn:
    """Clean up after ``exc`` ended the executor's step, tell the peers, raise the error."""
    action = executor.current
    if isinstance(exc, PeerFailure):
        where = f"at action {action}" if action is not None else "after its last action"
        if exc.published:
            message = f"rank {rank} stopped {where} because another rank failed: {exc}"
            report = str(exc)
        else:
            message = report = f"rank {rank} stopped {where}: {exc}"
        cause = None
    else:
        stage = f"stage {action.stage}, action {action}" if action is not None else \
            "at the end of the step"
        message = report = f"rank {rank}, {stage}: {type(exc).__name__}: {exc}"
        cause = exc
    executor.abort()
    traceback.clear_frames(exc.__traceback__)  # its frames hold pending operations
    executor.data_parallel.fail(report)
    p2p.publish_and_abort(report)
    _abort_tensor_parallel(executor.stages, report)
    logger.error("pipeline step failed: %s", message)
    raise PipelineError(message) from cause


def forget_frames(exc: BaseException) -> None:
    """Clear the variables of the finished frames in the tracebacks of ``exc`` and of its causes.

    Those frames hold the pipeline, its executor and the step's activations, and the exception
    can be in a reference cycle with one of them (pluggy's hook caller keeps the exception it
    re-raises in a local variable), which would keep the model alive after ``del pipe`` until
    the cyclic garbage collector runs. The traceback's text (files, lines) stays as it is.
    """
    pending, seen = [exc], set()
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        pending += [exc.__cause__, exc.__context__]


def _abort_tensor_parallel(stages: dict, report: str) -> None:
    """Tensor parallel stages: publish ``report`` on the tp groups' stores, abort and destroy
    the groups (as the dp driver does for FSDP's). As there, a tp peer already waiting in a
    collective for this rank may only be released at the group's timeout (gloo); its pipeline
    peers are told through the pipeline's own store at once."""
    import torch.distributed as dist  # lazy: only a failed step of a tp pipeline gets here

    from pp_core._torch_compat import process_group_store
    from pp_core.runtime.p2p import publish

    groups = {}
    for stage in stages.values():
        for param in stage.module.parameters():
            mesh = getattr(param, "device_mesh", None)
            if mesh is not None:
                for dim in range(mesh.ndim):
                    try:
                        group = mesh.get_group(dim)
                    except RuntimeError:  # already gone: the dp driver ended FSDP's groups
                        continue
                    groups[id(group)] = group
    for group in groups.values():
        try:
            publish(process_group_store(group), "pp_core/tp/error", report)
            # abort, not only destroy: the mesh keeps the group alive, and a peer waiting in a
            # collective is released only when the connections close
            group.abort()
            dist.destroy_process_group(group)
        except Exception:
            pass
