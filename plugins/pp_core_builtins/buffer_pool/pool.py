"""The receive-buffer pool: a few reusable buffer sets per stage and direction, sized by program.

torch keeps one receive-buffer set per microbatch and direction alive for the whole run. This
allocator keeps, per receive class (one stage of this rank, one direction), only as many sets as
the lowered program ever has live at once (:mod:`pp_core.schedule.buffer_plan`, interval colouring)
plus ``slack``, and hands them out again and again.

Safety. A buffer is handed out again only after the runtime says it is free: at ``consume``
(the pool then copies the message into fresh tensors, so the model's input leaf and the received
gradient never alias a buffer - activation checkpointing may recompute from its saved input at
any later time, and tensors that escape into autograd stay valid) or, for a runtime that does not
call ``consume``, at ``release`` (after the backward that lets autograd drop the buffer). If the
runtime ever needs more sets than planned (e.g. it frees later than the program says), the pool
grows instead of reusing a live buffer, and ``report()`` counts the overflow.

Variable shapes. Each tensor position of a set is a flat byte buffer that grows to the largest
message seen; requests are served as views of its prefix with the requested dtype and shape.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

from pp_core.errors import PipelineError
from pp_core.schedule.buffer_plan import BufferClass, plan_recv_buffers
from pp_core.schedule.ir import RECV_F

__all__ = ["RecvBufferPool"]


def _nbytes(meta) -> int:
    numel = 1
    for size in meta.shape:
        numel *= int(size)
    return numel * meta.dtype.itemsize


class _BufferSet:
    """One reusable set: a growable flat byte buffer per tensor position."""

    __slots__ = ("storages",)

    def __init__(self):
        self.storages: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.storages)

    def views(self, metas: Sequence, device: torch.device) -> list[torch.Tensor]:
        out = []
        for position, meta in enumerate(metas):
            need = _nbytes(meta)
            if position == len(self.storages):
                self.storages.append(torch.empty(need, dtype=torch.uint8, device=device))
            elif self.storages[position].numel() < need:  # grow to the largest message seen
                self.storages[position] = torch.empty(need, dtype=torch.uint8, device=device)
            flat = self.storages[position][:need]
            out.append(flat.view(meta.dtype).view(meta.shape))
        return out


class _ClassPool:
    """The sets of one receive class; free sets are reused least recently freed first."""

    __slots__ = ("planned", "sets", "free", "overflow", "default_bytes")

    def __init__(self, planned: int):
        self.planned = planned
        self.sets = [_BufferSet() for _ in range(planned)]
        self.free = deque(range(planned))
        self.overflow = 0
        self.default_bytes: dict[int, int] = {}  # microbatch -> largest message (torch's buffer)

    def take(self) -> int:
        if self.free:
            return self.free.popleft()
        self.sets.append(_BufferSet())
        self.overflow += 1
        return len(self.sets) - 1


class RecvBufferPool:
    """An allocator (see ``pp_core.runtime.allocator``) that reuses a few buffer sets per class.

    :param program: this rank's lowered program (:class:`pp_core.schedule.lower.RankProgram`).
    :param device: where the buffers live.
    :param slack: spare sets per class (``PipelineConfig.pp_recv_buffer_pool_slack``).
    """

    def __init__(self, program, device, slack: int = 2):
        self.program = program
        self.device = torch.device(device)
        self.slack = slack
        self.plan = plan_recv_buffers(program, slack)
        self._class_of = [BufferClass(lt.action.stage, lt.action.kind)
                          for lt in program.recv_lifetimes]
        self.pools = {c: _ClassPool(p.sets) for c, p in self.plan.classes.items()}
        self._held: dict[int, int] = {}  # lifetime index -> set index, while in use
        self.consumed_messages = 0

    # ------------------------------------------------------------------ allocator protocol
    def allocate(self, lifetime: int, metas: Sequence) -> list[torch.Tensor]:
        """Buffers for receive ``lifetime`` (an index into ``program.recv_lifetimes``)."""
        if lifetime in self._held:
            raise PipelineError(f"receive {self._action(lifetime)} was allocated twice without "
                                f"release; the runtime must release a receive before reusing it")
        pool = self._pool(lifetime)
        index = pool.take()
        self._held[lifetime] = index
        microbatch = self.program.recv_lifetimes[lifetime].action.microbatch
        size = sum(_nbytes(m) for m in metas)
        pool.default_bytes[microbatch] = max(pool.default_bytes.get(microbatch, 0), size)
        return pool.sets[index].views(metas, self.device)

    def consume(self, lifetime: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy a completed message out of its buffers and free them; the copies go to the model.

        Each copy is a fresh contiguous tensor that shares no memory with the pool, so the input
        leaf (or the gradient) autograd keeps is independent of the buffer's next message.
        """
        copies = [t.clone(memory_format=torch.contiguous_format) for t in tensors]
        self._free(lifetime)
        self.consumed_messages += 1
        return copies

    def release(self, lifetime: int) -> None:
        """The runtime is done with receive ``lifetime``; free its set unless ``consume`` did."""
        self._free(lifetime)

    def reset(self) -> None:
        """End of a step (or a failure): every set is free again."""
        for lifetime in list(self._held):
            self._free(lifetime)

    # ------------------------------------------------------------------ reporting
    def report(self) -> list[dict]:
        """Per receive class: sets and bytes with the pool and without it (torch: one per mb).

        ``default_bytes`` is what torch's allocator would hold: one set per microbatch, each the
        size of that microbatch's largest message so far. ``pool_bytes`` is what the pool holds.
        """
        rows = []
        for buffer_class, pool in self.pools.items():
            class_plan = self.plan.classes[buffer_class]
            rows.append({
                "stage": buffer_class.stage,
                "direction": "F" if buffer_class.kind is RECV_F else "B",
                "default_sets": class_plan.default_sets,
                "lower_bound": class_plan.lower_bound,
                "planned_sets": class_plan.sets,
                "pool_sets": len(pool.sets),
                "overflow": pool.overflow,
                "default_bytes": sum(pool.default_bytes.values()),
                "pool_bytes": sum(s.nbytes for s in pool.sets),
            })
        return rows

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds now."""
        return sum(s.nbytes for pool in self.pools.values() for s in pool.sets)

    # ------------------------------------------------------------------ internals
    def _action(self, lifetime: int):
        return self.program.recv_lifetimes[lifetime].action

    def _pool(self, lifetime: int) -> _ClassPool:
        if not 0 <= lifetime < len(self._class_of):
            raise PipelineError(f"rank {self.program.rank}: receive lifetime {lifetime} is not in "
                                f"this rank's program ({len(self._class_of)} receives); the "
                                f"allocator was built for a different program")
        return self.pools[self._class_of[lifetime]]

    def _free(self, lifetime: int) -> None:
        index = self._held.pop(lifetime, None)
        if index is not None:
            self._pool(lifetime).free.append(index)

    def __repr__(self) -> str:
        sets = ", ".join(f"{c}: {len(p.sets)}" for c, p in self.pools.items())
        return f"RecvBufferPool(rank={self.program.rank}, slack={self.slack}, sets={{{sets}}})"
