"""Activation checkpointing per block, with one recompute even when I and W run apart.

``full``: a checkpointed block keeps only its inputs during forward; its forward runs again the
first time backward needs one of its activations. ``selective``: the same, except that the
outputs of matmul-class ops (``mm``, ``addmm``, ``bmm``, ``baddbmm``, scaled-dot-product
attention) are kept, so the recompute redoes only the cheap ops (norms, activations,
element-wise); it uses torch's own selective-checkpoint contexts. ``every: N`` checkpoints every
N-th block (block index divisible by N, counted in the unsplit model, so the choice does not
depend on the split).

Why not ``torch.utils.checkpoint``: its non-reentrant mode recomputes once per autograd *graph
task*, and a split backward is several graph tasks (``I``, then one per parameter group in
``W``), so a block would be recomputed for ``I`` and again for ``W``. Here the recomputed
activations are kept in the block's frame until autograd drops the last reference to them (a
saved-tensor handle dies with its graph node): one recompute per block per microbatch, whatever
the schedule; between ``I`` and ``W`` a checkpointed block holds the activations ``W`` needs.

Blocks are wrapped *in place* (an instance ``forward``), so parameter names do not change. Under
``torch.compile`` (:func:`pp_core.parallel.apply_compile` after this), the compiled block uses
``torch.utils.checkpoint`` with the same policy instead, which the compiler turns into a
recompute inside the block's single compiled backward.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, create_selective_checkpoint_contexts,
                                    get_device_states, set_device_states)

from pp_core.errors import ConfigError, PipelineError
from pp_core.parallel.blocks import block_index, find_blocks

__all__ = ["apply_activation_checkpointing", "checkpoint_block", "restore_block",
           "apply_stage_checkpointing", "MODES"]

MODES = ("none", "full", "selective")
_ATTR = "_pp_activation_checkpointing"  # (mode, the forward before wrapping)


def _matmul_ops() -> set:
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention"]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SAVED_OPS = _matmul_ops()


def selective_contexts():
    """The ``context_fn`` of ``torch.utils.checkpoint`` for ``selective`` (matmul outputs kept).

    The matmul outputs it keeps bypass saved-tensor hooks, as they always have; torch 2.15 warns
    about that whenever hooks are active (every pp-core run has one: ``peak_saved_bytes``) and
    takes an explicit choice on the forward context (``respect_saved_tensors_hooks``, which
    ``checkpoint()`` sets the same way). The legacy behaviour is chosen, the same on every torch."""
    forward, recompute = create_selective_checkpoint_contexts(_save_matmuls)
    forward.respect_saved_tensors_hooks = False  # read by torch >= 2.15, a plain attribute before
    return forward, recompute


_REPLAYS: list = []
"""What a recompute must run inside besides the forward's RNG and autocast: callables run when
a checkpointed call's forward runs, each returning a context-manager factory for its recompute,
or ``None``. Sequence slices register one (:mod:`pp_core.runtime.seq_slices`): a checkpointed
block of a slice recomputes over the prefix that slice's forward read."""


def replay_in_recompute(capture) -> None:
    """Register ``capture`` (see :data:`_REPLAYS`); once per callable."""
    if capture not in _REPLAYS:
        _REPLAYS.append(capture)


class _Handle:
    """What autograd stores instead of a saved tensor; its death frees the recomputed tensor."""

    __slots__ = ("frame", "index", "__weakref__")

    def __init__(self, frame: "_Frame", index: int):
        self.frame, self.index = frame, index
        frame.alive.add(index)

    def __del__(self):
        self.frame.alive.discard(self.index)
        self.frame.values.pop(self.index, None)


class _Frame:
    """One checkpointed call: what its recompute needs, and the recomputed tensors."""

    def __init__(self, fn, args, kwargs, selective: bool):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.rng = torch.get_rng_state()
        self.devices, self.device_states = get_device_states(*args)
        self.autocast = [(device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                         if torch.is_autocast_enabled(device)]
        self.recompute_context = contextlib.nullcontext
        self.forward_context = contextlib.nullcontext()
        if selective:
            self.forward_context, recompute = selective_contexts()
            self.recompute_context = lambda: recompute
        self.replays = [r for r in (capture() for capture in _REPLAYS) if r is not None]
        self.count = 0
        self.alive: set[int] = set()
        self.values: dict[int, torch.Tensor] = {}
        self.recomputed = False

    def pack(self, tensor):
        handle = _Handle(self, self.count)
        self.count += 1
        return handle

    def unpack(self, handle: _Handle):
        if not self.recomputed:
            self._recompute()
        value = self.values.get(handle.index)
        if value is None:
            raise PipelineError("activation checkpointing: a saved activation was used after it "
                                "was released; please report this with the model")
        return value

    def _recompute(self) -> None:
        recomputed: list[torch.Tensor] = []
        args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
                     else a for a in self.args)
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.rng)
            if self.devices:
                set_device_states(self.devices, self.device_states)
            with contextlib.ExitStack() as stack:  # the forward's autocast state, not backward's
                for device, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device, dtype=dtype))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(self.recompute_context())
                for replay in self.replays:
                    stack.enter_context(replay())
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(  # detached: a
                    # kept tensor must not hold the recompute's graph, whose hooks hold the list
                    lambda t: recomputed.append(t.detach()) or len(recomputed) - 1, _no_unpack))
                self.fn(*args, **self.kwargs)
        if len(recomputed) != self.count:
            raise PipelineError(
                f"activation checkpointing: the recomputed forward saved {len(recomputed)} "
                f"tensors, the forward {self.count}; the block's forward must do the same work "
                f"each time (no data-dependent branches on global state)")
        self.values = {i: t for i, t in enumerate(recomputed) if i in self.alive}
        self.recomputed = True
        self.args = self.kwargs = None
        self.replays = []


def _no_unpack(index):  # pragma: no cover - the recompute's graph is dropped, never run
    raise PipelineError("activation checkpointing: the recomputed graph was backpropagated")


def checkpointed_call(fn, selective: bool, args, kwargs):
    """``fn(*args, **kwargs)`` keeping no activation: they are recomputed once when needed."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    frame = _Frame(fn, args, kwargs, selective)
    with frame.forward_context, torch.autograd.graph.saved_tensors_hooks(frame.pack,
                                                                         frame.unpack):
        return fn(*args, **kwargs)


def checkpoint_block(block: nn.Module, mode: str = "full") -> nn.Module:
    """Checkpoint ``block`` in place (its ``forward`` is wrapped; names do not change)."""
    if mode not in ("full", "selective"):
        raise ConfigError(f"activation checkpointing mode {mode!r}: expected 'full' or "
                          f"'selective'")
    if getattr(block, _ATTR, None) is not None:
        return block
    original = block.forward
    selective = mode == "selective"

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return checkpointed_call(original, selective, args, kwargs)

    block.forward = forward
    setattr(block, _ATTR, (mode, original))
    return block


def restore_block(block: nn.Module) -> nn.Module:
    """Undo :func:`checkpoint_block` (the profiler measures a block both ways)."""
    state = getattr(block, _ATTR, None)
    if state is None:
        return block
    original = state[1]
    del block.forward
    if block.forward != original:  # it was an instance attribute itself (another wrapper)
        block.forward = original
    delattr(block, _ATTR)
    return block


def checkpoint_mode(block: nn.Module) -> tuple[str, object] | None:
    """``(mode, original forward)`` of a block :func:`checkpoint_block` wrapped, else None."""
    return getattr(block, _ATTR, None)


def apply_activation_checkpointing(parts: Iterable[nn.Module], mode: str = "full",
                                   every: int = 1) -> list[str]:
    """Checkpoint every ``every``-th block of each part in place; returns the blocks' FQNs.

    :param parts: this rank's model parts (``pipe.model_parts``) or whole models.
    :param mode: ``"none"`` (nothing), ``"full"`` or ``"selective"`` (module docstring).
    :param every: checkpoint blocks whose index in the unsplit model is a multiple of it.
    """
    if mode not in MODES:
        raise ConfigError(f"activation_checkpointing.mode: expected one of {', '.join(MODES)}, "
                          f"found {mode!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"activation_checkpointing.every: expected a positive int, found "
                          f"{every!r}")
    if mode == "none":
        return []
    done = []
    for part in parts:
        for position, (fqn, block) in enumerate(find_blocks(part)):
            index = block_index(fqn)
            if (position if index is None else index) % every == 0:
                checkpoint_block(block, mode)
                done.append(fqn)
    return done


def apply_stage_checkpointing(parts: Iterable[nn.Module], stages: Iterable[int],
                              modes: list[str], every: int = 1) -> list[str]:
    """Checkpoint each part by its own stage's mode: ``modes[stage]`` for the part of
    ``stage`` (the planner's choice per stage, ``train.activation_checkpointing.mode`` as a
    list); returns the checkpointed blocks' FQNs."""
    done = []
    for part, stage in zip(parts, stages):
        done += apply_activation_checkpointing([part], modes[stage], every)
    return done
