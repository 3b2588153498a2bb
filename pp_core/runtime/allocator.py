"""Where receive buffers come from: the allocator protocol, and the default allocator.

The runtime asks an allocator for the buffers of every received message and tells it when the
buffers are free again. A plugin can supply its own allocator through the
``pp_make_recv_buffer_allocator(config, program, rank, device)`` hook (first non-``None`` result
wins) - e.g. a pool sized from the program's receive-buffer lifetimes by interval colouring. With
no plugin answering, :class:`DefaultRecvBufferAllocator` allocates fresh tensors, as torch does.

Protocol, as the executor uses it (``lifetime`` is an index into ``program.recv_lifetimes``; see
:mod:`pp_core.schedule.lower` for what ``posted``, ``consumed`` and ``released`` mean):

* ``allocate(lifetime, metas)`` - called once per message, between ``posted`` and ``consumed``
  (at ``posted`` when shapes are static or predicted, later when a header must arrive first);
  ``metas`` is a list of :class:`pp_core.runtime.wire.TensorMeta` (shape, dtype,
  requires_grad). Return one contiguous tensor per meta, of exactly that shape and dtype, on the
  allocator's device. The buffers must not be handed out again before ``release(lifetime)``.
  When a predicted shape turns out wrong, the runtime calls ``release(lifetime)`` and then
  ``allocate`` again for the same lifetime.
* ``consume(lifetime, tensors)`` (optional) - called when the message has arrived, right before
  the compute at ``consumed``; returns the tensors the runtime uses instead (e.g. copies, which
  lets the allocator reuse the buffers at once). Without it the model gets views of the buffers.
* ``release(lifetime)`` - called once the action at ``released`` has finished *and* every send
  issued before it has completed; the runtime keeps no reference to the buffers afterwards (the
  tensors it gave to the model were views of them, and autograd has freed them by then).
* ``reset()`` (optional) - called at the end of every step and after a failure; every buffer is
  free then.

A message with no tensors never reaches the allocator.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from pp_core.errors import PluginError

__all__ = ["RecvBufferAllocator", "DefaultRecvBufferAllocator", "make_recv_buffer_allocator"]


@runtime_checkable
class RecvBufferAllocator(Protocol):
    """Gives the runtime its receive buffers (see the module docstring for the contract)."""

    def allocate(self, lifetime: int, metas: Sequence) -> list[torch.Tensor]:
        ...

    def release(self, lifetime: int) -> None:
        ...


class DefaultRecvBufferAllocator:
    """A fresh ``torch.empty`` per tensor; memory returns to torch's allocator when unused."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def allocate(self, lifetime: int, metas: Sequence) -> list[torch.Tensor]:
        device = self.device
        return [torch.empty(meta.shape, dtype=meta.dtype, device=device) for meta in metas]

    def release(self, lifetime: int) -> None:
        pass

    def reset(self) -> None:
        pass


def make_recv_buffer_allocator(plugins, config, program, rank: int, device) -> RecvBufferAllocator:
    """The first plugin's allocator for this rank, or the default one."""
    allocator = None
    if plugins is not None:
        try:
            allocator = plugins.recv_buffer_allocator(config, program, rank, device)
        except Exception as exc:
            raise PluginError(f"pp_make_recv_buffer_allocator raised on rank {rank}: "
                              f"{type(exc).__name__}: {exc}") from exc
    if allocator is None:
        return DefaultRecvBufferAllocator(device)
    missing = [name for name in ("allocate", "release") if not callable(getattr(allocator, name, None))]
    if missing:
        raise PluginError(f"the receive-buffer allocator {type(allocator).__qualname__} has no "
                          f"{' or '.join(missing)}(); see pp_core.runtime.allocator for the protocol")
    return allocator
