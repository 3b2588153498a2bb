"""``torch.compile`` per block, in place, after activation checkpointing (as torchtitan does).

Each block is compiled with ``nn.Module.compile`` (parameter names do not change). A block that
:mod:`pp_core.parallel.activation` checkpointed is compiled around ``torch.utils.checkpoint``
with the same policy, which the compiler understands: the recompute then lives inside the
block's one compiled backward. Compiled blocks and split backward (zero-bubble, V schedules):
torch fuses a block's backward into one node that computes input and weight gradients together,
so for a compiled block ``W`` has nothing left to compute (:mod:`pp_core.runtime.backward`).
``torch._functorch.config.donated_buffer`` is turned off for the process, torch's documented
switch for backward passes that retain the graph, as ``I`` does; so is dynamo's
``skip_fwd_side_effects_in_bwd_under_checkpoint`` when a checkpointed block is compiled
(:func:`pp_core._torch_compat.allow_forward_side_effects_under_checkpoint`: a forward that sets
Python state, as every HF attention does under transformers 5.25, would otherwise break the graph
inside the checkpoint). Order with the other wrappers:
activation checkpointing, then compile, then FSDP.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch.compiler
from torch import nn
from torch.utils.checkpoint import checkpoint

from pp_core._torch_compat import allow_forward_side_effects_under_checkpoint, \
    disable_donated_buffers
from pp_core.errors import ConfigError
from pp_core.parallel.compile_options import compile_problem
from pp_core.parallel.activation import checkpoint_mode, selective_contexts
from pp_core.parallel.blocks import find_blocks

__all__ = ["apply_compile", "run_eagerly_when_compiled"]

_EAGER: list = []  # (class, method name): run eagerly inside compiled blocks (apply_compile)


def run_eagerly_when_compiled(owner: type, name: str) -> None:
    """Have :func:`apply_compile` wrap ``owner.name`` (a method) with ``torch.compiler.disable``
    before it compiles anything, so a compiled block runs it eagerly (a graph break). Registering
    costs nothing: the wrapping imports dynamo (seconds), which only a compiling process pays."""
    _EAGER.append((owner, name))


def _disable_registered() -> None:
    for owner, name in _EAGER:
        method = owner.__dict__[name]
        if not getattr(method, "pp_core_eager", False):
            eager = torch.compiler.disable(method, reason=f"{owner.__name__}.{name} runs eagerly "
                                                          f"(pp_core.parallel.compile)")
            eager.pp_core_eager = True
            setattr(owner, name, eager)


def _compile_checkpointed(block: nn.Module, mode: str, original) -> None:
    kwargs = {"context_fn": selective_contexts} if mode == "selective" else {}

    @functools.wraps(original)
    def forward(*args, **kw):
        return checkpoint(original, *args, use_reentrant=False, **kwargs, **kw)

    block.forward = forward


def apply_compile(parts: Iterable[nn.Module], **options) -> list[str]:
    """Compile every block of each part in place with ``block.compile(**options)``.

    :param options: ``torch.compile`` keyword arguments (``mode``, ``fullgraph``, ``dynamic``,
        ``backend``, ...). Returns the FQNs of the compiled blocks.
    """
    problem = compile_problem(options)
    if problem is not None:
        raise ConfigError(f"apply_compile: {problem}")
    disable_donated_buffers()
    _disable_registered()
    done = []
    for part in parts:
        for fqn, block in find_blocks(part):
            checkpointed = checkpoint_mode(block)
            if checkpointed is not None:
                allow_forward_side_effects_under_checkpoint()
                _compile_checkpointed(block, *checkpointed)
            block.compile(**options)
            done.append(fqn)
    return done
