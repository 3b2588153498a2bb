"""Built-in plugin: the receive-buffer pool (``PipelineConfig.pp_recv_buffer_pool=True``).

Without it the runtime allocates receive buffers like torch, one set per microbatch and
direction. With it, each rank keeps per stage and direction only the most receives its lowered
program ever has live at once (interval colouring of the receive lifetimes, see
``pp_core.schedule.buffer_plan``) plus ``pp_recv_buffer_pool_slack`` spare sets, for every schedule:
1F1B, GPipe, looped BFS, interleaved, zero-bubble, V, DualPipeV and CSV schedules. See
``docs/buffer_pool.md``.

A third party replaces it by implementing the same hook (first non-``None`` wins), e.g. to hand
out memory registered with a custom transport; disable this one with
``PP_CORE_DISABLE_PLUGINS=pp_core_builtins.buffer_pool``.

Loading this entry point does not import torch (``pp-core schedule`` loads every plugin): the
pool's module loads when a rank asks for an allocator, or on ``from pp_core_builtins.buffer_pool import
RecvBufferPool``.
"""

from __future__ import annotations

from pp_core import hookimpl
from pp_core.lazy import lazy_face

__all__ = ["RecvBufferPool", "pp_make_recv_buffer_allocator"]

__getattr__, __dir__ = lazy_face(__name__, {"RecvBufferPool": ".pool"})  # lazy: torch


@hookimpl
def pp_make_recv_buffer_allocator(config, program, rank, device):
    """A :class:`RecvBufferPool` for this rank when ``config.pp_recv_buffer_pool`` is true."""
    if not getattr(config, "pp_recv_buffer_pool", False):
        return None
    from pp_core_builtins.buffer_pool.pool import RecvBufferPool  # lazy: torch

    return RecvBufferPool(program, device, slack=config.pp_recv_buffer_pool_slack)
