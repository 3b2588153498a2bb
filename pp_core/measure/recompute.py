"""What activation checkpointing costs and saves, per unit and built-in mode (``full``,
``selective``): measured by running the units with their blocks checkpointed as a run does.

The profiler (:mod:`pp_core.measure.profile`) calls :func:`measure_recompute` after its own
passes, on the same unit parts. Per mode, every unit that has blocks (the ``layers`` entries a
run checkpoints, :func:`pp_core.parallel.blocks.find_blocks`) gets them wrapped in place by
:func:`pp_core.parallel.activation.checkpoint_block`, and unwrapped again afterwards:

* **bytes kept for backward**: what the unit's forward made and still holds when it returns
  (its outputs left out: the next unit holds them) plus its inputs (the checkpoint keeps them;
  without it the first op that saves the input counts them too). ``selective`` keeps the matmul
  outputs on top of that;
* **the recompute's transient**: the most bytes the forward + backward hold at once beyond
  those kept and the parameter gradients - the recomputed activations and the backward's own
  temporaries, all alive at the top of the backward;
* **time**: ``F``, then ``B`` and ``I`` with the forward run again inside them (``W`` does
  not recompute: the recomputed activations stay with the graph until it is freed), medians of
  ``repeats`` passes by the profiler's clock.

Each entry is ``(mode, forward_s, backward_s, input_grad_s, activation_bytes,
transient_bytes)``: :attr:`pp_core.planning.costs.UnitCost.recompute`.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from typing import Sequence

from pp_core.errors import ConfigError
from pp_core.measure.transient import Allocations, storages
from pp_core.parallel.activation import checkpoint_block, restore_block
from pp_core.parallel.blocks import find_blocks
from pp_core.runtime.backward import backward_full, backward_input, backward_weight
from pp_core.runtime.stage import make_stage_inputs

__all__ = ["measure_recompute", "RECOMPUTE_MODES"]

RECOMPUTE_MODES = ("full", "selective")
"""The built-in activation-checkpointing modes the profiler measures."""


def _blocks(part) -> list:
    try:
        return [block for _, block in find_blocks(part)]
    except ConfigError:  # no blocks (an embedding or a head unit): nothing to checkpoint
        return []


@contextlib.contextmanager
def _checkpointed(blocks, mode: str):
    for block in blocks:
        checkpoint_block(block, mode)
    try:
        yield
    finally:
        for block in blocks:
            restore_block(block)


def _kept_bytes(log: Allocations, handed) -> int:
    """Bytes the log's allocations still hold, the storages of ``handed`` left out."""
    sizes = {ident: delta for ident, delta in log.events if delta > 0}
    out = {storage.data_ptr() for storage in storages(handed)}
    return sum(sizes[ident] for ptr, ident in log.live.items() if ptr not in out)


def _pass(runner, x, target, loss_fn, split: bool, logs: list | None = None):
    """One microbatch through every unit: per unit ``F``, ``B`` (or ``I``), and with ``logs``
    the bytes kept for backward as ``(made by the unit, its inputs)``."""
    n = len(runner.stages)
    forward, backward, kept = [0.0] * n, [0.0] * n, [0] * n
    grad_outs, leaves, handed = [None] * n, [()] * n, ()
    track = (lambda i: logs[i].tracking()) if logs else (lambda i: contextlib.nullcontext())
    for i in range(n):
        leaves[i] = () if i == 0 else make_stage_inputs(handed, True)
        with track(i):
            (grad_outs[i], handed), forward[i] = runner.timed(functools.partial(
                runner.forward, x, target, loss_fn, i, leaves[i]))
        if logs:  # what it made and holds, and its inputs (the checkpoint holds them)
            kept[i] = (_kept_bytes(logs[i], handed),
                       sum(s.nbytes() for s in storages(list(leaves[i]))))
    grads, pending = None, [None] * n
    for i in reversed(range(n)):
        inputs = [t for t in leaves[i] if t.requires_grad]
        run = backward_input if split else backward_full
        with track(i):
            result, backward[i] = runner.timed(functools.partial(run, grad_outs[i], grads,
                                                                 inputs))
        grad_outs[i] = None
        if split:
            grads, pending[i] = result
        else:
            grads = result
    if split:
        for state in reversed(pending):
            backward_weight(state)
    return forward, backward, kept


def measure_recompute(runner, x, target, loss_fn, repeats: int,
                      modes: Sequence[str] = RECOMPUTE_MODES) -> list[tuple]:
    """Per unit, a tuple of ``(mode, forward_s, backward_s, input_grad_s, activation_bytes,
    transient_bytes)`` for each of ``modes`` (empty for a unit without blocks)."""
    blocks = [_blocks(stage.module) for stage in runner.stages]
    n = len(blocks)
    out: list[list[tuple]] = [[] for _ in range(n)]
    every = [b for unit in blocks for b in unit]
    if not every:
        return [() for _ in range(n)]
    for mode in modes:
        with _checkpointed(every, mode):
            logs = [Allocations() for _ in range(n)]
            _, _, kept = _pass(runner, x, target, loss_fn, False, logs)  # warm-up + memory
            transient = [max(0, logs[i].peak([p.grad for p in runner.params[i]
                                               if p.grad is not None]) - kept[i][0])
                         for i in range(n)]
            samples = {k: [[] for _ in range(n)] for k in "FBI"}
            for _ in range(repeats):
                f, b, _ = _pass(runner, x, target, loss_fn, False)
                _, inp, _ = _pass(runner, x, target, loss_fn, True)
                for i in range(n):
                    samples["F"][i].append(f[i])
                    samples["B"][i].append(b[i])
                    samples["I"][i].append(inp[i])
        for group in runner.params:
            for p in group:
                p.grad = None
        for i in range(n):
            if blocks[i]:
                out[i].append((mode, statistics.median(samples["F"][i]),
                               statistics.median(samples["B"][i]),
                               statistics.median(samples["I"][i]), sum(kept[i]), transient[i]))
    return [tuple(entries) for entries in out]
