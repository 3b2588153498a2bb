"""Drive torch's data parallelism (FSDP2 ``fully_shard``/``replicate``, DDP) inside a pipeline step.

A data-parallel engine reduces gradients at the end of each ``loss.backward()``. A pipeline runs
many backwards per stage and step (one per microbatch, two with split backward) and some of them
never reach the engine's hooks, so left alone it would reduce per microbatch - or worse. Under
split backward (``I`` then ``W``) FSDP2's post-backward hook sits on the module *inputs*: it fires
during ``I``, before ``W`` has accumulated any parameter gradient, reduce-scatters nothing and
reshards; ``W`` then writes the gradients into the unsharded parameters where no reduce-scatter
ever picks them up (they leak into the next step). That is why zero-bubble schedules gave wrong
gradients without an error.

So a stage's engines are driven by the step, not by autograd (as torch's own
``torch.distributed.pipelining`` stage does for FSDP in ``backward_maybe_with_nosync`` and
``perform_reduce_grad``):

* FSDP2: at the start of the step gradient sync, resharding after backward and "last backward"
  are switched off; every backward of the stage then only accumulates into the unsharded
  gradients. Before each backward the parameters are unsharded (a no-op unless they were
  resharded after a forward), so ``W`` always finds them. After the stage's last backward of the
  step (the last ``B`` or ``W``) each parameter group runs its post-backward once - one
  reduce-scatter per FSDP unit - and reshards; with ``reshard_after_forward=False`` that makes one
  all-gather per unit per step.
* DDP (with ``patch_stage_backward_maybe_with_nosync=True``): every forward runs under
  ``no_sync``; the reducer is armed (``prepare_for_backward``) just before the stage's last
  backward, which all-reduces the accumulated gradients once. DDP's reducer needs that backward to
  produce every gradient in one autograd run, which a split ``W`` does not (it runs one per
  parameter group), so DDP with a split-backward schedule is refused: use ``replicate`` or
  ``fully_shard``, which are driven like FSDP2.

Failures. A rank whose step fails publishes its report in the store of each of its FSDP
process groups and destroys them (:meth:`DataParallelDriver.fail`), as it does for the
pipeline's group; a dp peer whose collective of the step fails raises
:class:`~pp_core.runtime.p2p.PeerFailure` with that report and passes it on to its own pp peers.
Known limit (docs/data_parallel.md): destroying the group does not close the gloo connections a
peer already waiting in a collective is blocked on, so it fails only at the dp group's timeout
(then with the named error), not at once.

The calls into torch's private FSDP/DDP state live in :mod:`pp_core._torch_compat`.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from typing import Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pp_core._torch_compat import (ddp_arm_reducer, fsdp_process_groups, fsdp_reduce_and_reshard,
                                   fsdp_reset, process_group_store)
from pp_core.errors import ConfigError
from pp_core.runtime.p2p import PeerFailure, publish
from pp_core.schedule.ir import B, I, W

__all__ = ["DataParallelDriver", "StageDataParallel", "make_data_parallel"]

ERROR_KEY = "pp_core/dp/error"
"""Where a failing rank publishes its report in each of its FSDP groups' stores."""


def _fsdp_modules(part) -> list:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    if fsdp is None:
        return []
    return [m for m in part.modules() if isinstance(m, fsdp.FSDPModule)]


def _ddp(part):
    return part if isinstance(part, DistributedDataParallel) else None


class StageDataParallel:
    """The data-parallel engines of one stage, and what the step does with them."""

    def __init__(self, stage_index: int, fsdp: list, ddp, ddp_nosync: bool):
        self.stage_index = stage_index
        self.fsdp = fsdp
        self.ddp = ddp if ddp_nosync else None
        self.groups = fsdp_process_groups(fsdp)

    # ---------------------------------------------------------------- step
    def begin_step(self) -> None:
        for module in self.fsdp:
            module.set_requires_gradient_sync(False, recurse=False)
            module.set_reshard_after_backward(False, recurse=False)
            module.set_is_last_backward(False)

    def forward(self):
        """Context of every forward of the stage (DDP: no sync, the reducer is armed later)."""
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def backward(self, outputs, last: bool):
        """Around each backward action (B, I, W) of the stage; ``last``: its last of the step."""
        with self._collectives():
            for module in self.fsdp:
                module.unshard()  # no-op when unsharded; W never passes FSDP's pre-backward hook
        if last and self.ddp is not None:
            ddp_arm_reducer(self.ddp, outputs)
        yield
        if last and self.fsdp:
            with self._collectives():
                self._reduce_and_reshard()

    @contextlib.contextmanager
    def _collectives(self):
        """FSDP's collectives fail when a dp peer failed and aborted the group: say why."""
        try:
            yield
        except Exception as exc:
            raise PeerFailure(*self._peer_report(exc)) from exc

    def _peer_report(self, exc: BaseException) -> tuple[str, bool]:
        for group in self.groups:
            try:  # a failing peer publishes before it aborts the group
                store = process_group_store(group)
                store.wait([ERROR_KEY], datetime.timedelta(seconds=2))
                return store.get(ERROR_KEY).decode(errors="replace"), True
            except Exception:
                continue
        first_line = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        return (f"stage {self.stage_index}'s data-parallel collective failed, no dp peer said "
                f"why ({type(exc).__name__}: {first_line})"), False

    def fail(self, report: str) -> None:
        """This rank's step failed: tell the dp peers why, and destroy the FSDP groups. That
        does not release a peer already waiting on this rank in a collective (see the module's
        docstring): it fails at the group's timeout, then raises the published report."""
        while self.groups:
            group = self.groups.pop()
            try:
                publish(process_group_store(group), ERROR_KEY, report)
                dist.destroy_process_group(group)
            except Exception:
                pass
            del group


    def _reduce_and_reshard(self) -> None:
        """Reduce the step's accumulated gradients once per FSDP unit, then reshard."""
        for module in self.fsdp:
            module.set_requires_gradient_sync(True, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
            module.set_is_last_backward(True)
        fsdp_reduce_and_reshard(self.fsdp)

    def abort(self) -> None:
        """After a failed step: drop FSDP's per-iteration state so the parts stay usable."""
        fsdp_reset(self.fsdp)


class DataParallelDriver:
    """What a training step does with its stages' engines; with none, nothing (the default)."""

    def __init__(self, stages: Optional[dict] = None, actions=()):
        self.stages: dict[int, StageDataParallel] = stages or {}
        self.last = last_backward_positions(actions) if self.stages else {}

    def begin_step(self) -> None:
        for stage in self.stages.values():
            stage.begin_step()

    def forward(self, stage_index: int, train: bool):
        stage = self.stages.get(stage_index) if train else None
        return stage.forward() if stage is not None else contextlib.nullcontext()

    def backward(self, stage_index: int, position: int, outputs=()):
        """Around the backward action at ``position`` of the rank's program (B, I or W)."""
        stage = self.stages.get(stage_index)
        if stage is None:
            return contextlib.nullcontext()
        return stage.backward(outputs, last=self.last[stage_index] == position)

    def abort(self) -> None:
        for stage in self.stages.values():
            stage.abort()

    def fail(self, report: str) -> None:
        """After :meth:`abort` of a failed step: publish ``report`` to the dp peers and abort
        the FSDP process groups (see the module's docstring)."""
        for stage in self.stages.values():
            stage.fail(report)


def make_data_parallel(stages: dict, config, actions) -> DataParallelDriver:
    """The driver of the stages (``{index: Stage}``) whose part uses torch's data parallelism;
    ``actions``: this rank's program. Raises ConfigError for DDP under split backward."""
    split_backward = any(action.kind is I for action in actions)
    result: dict[int, StageDataParallel] = {}
    for index, stage in stages.items():
        part = stage.module
        fsdp, ddp = _fsdp_modules(part), _ddp(part)
        nosync = bool(config.patch_stage_backward_maybe_with_nosync)
        if ddp is not None and split_backward:
            raise ConfigError(
                f"stage {index} is wrapped in DistributedDataParallel, whose reducer cannot follow "
                f"a split backward (I/W) of schedule {config.pp_schedule!r}; wrap the parts with "
                f"torch's replicate() or fully_shard() instead (pp_core.parallel."
                f"apply_data_parallel), or use a schedule without split backward (1f1b, gpipe, "
                f"interleaved_1f1b)")
        if fsdp or (ddp is not None and nosync):
            result[index] = StageDataParallel(index, fsdp, ddp, nosync)
    return DataParallelDriver(result, actions)


def last_backward_positions(actions) -> dict[int, int]:
    """``{stage: position of its last B or W}`` in a rank's program (the step's last backward;
    with split backward ``W`` comes after ``I``)."""
    last: dict[int, int] = {}
    for position, action in enumerate(actions):
        if action.kind is B or action.kind is W:
            last[action.stage] = position
    return last
