"""Split backward (I then W) over ``torch.compile``d blocks: the gradients of the full backward,
and each compiled backward runs once per microbatch.

The failure this guards against (pytorch#161904): a compiled block whose backward was built by a
full backward (``retain_graph=False``, so torch donates its saved buffers) then meets ``I``,
which retains the graph for ``W``: torch raised "compiled with non-empty donated buffers". The
``aot_eager`` backend builds the same autograd node (``CompiledFunctionBackward``) as inductor,
without the C++ compile, so these tests stay fast.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pp_core.runtime.backward import backward_full, backward_input, backward_weight


class Gated(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(width, width)

    def forward(self, x):
        value, gate = self.up(x).chunk(2, -1)
        return x + self.down(value * torch.sigmoid(gate))


@pytest.fixture(autouse=True)
def donation_on():
    """torch's default, whatever an earlier test (pp_core.parallel.apply_compile) set."""
    from torch._functorch import config

    with config.patch(donated_buffer=True):
        yield


def _stage():
    torch.manual_seed(0)
    return nn.Sequential(Gated(), Gated(), nn.Linear(8, 8))


def _compiled(stage):
    for block in list(stage)[:2]:
        block.compile(backend="aot_eager")
    return stage


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def test_split_backward_of_compiled_blocks_after_a_full_backward_matches_eager():
    eager = _stage()
    compiled = _compiled(copy.deepcopy(eager))
    x, grad_out = _data()
    compiled(x.clone().requires_grad_()).backward(grad_out)  # builds the backward, donating
    compiled.zero_grad()

    want_x = x.clone().requires_grad_()
    want = backward_full([eager(want_x)], [grad_out], [want_x])
    got_x = x.clone().requires_grad_()
    got, state = backward_input([compiled(got_x)], [grad_out], [got_x])
    backward_weight(state)

    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    for (name, p_eager), (_, p_compiled) in zip(eager.named_parameters(),
                                                compiled.named_parameters()):
        torch.testing.assert_close(p_compiled.grad, p_eager.grad, atol=1e-6, rtol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_each_compiled_backward_runs_once_across_input_and_weight():
    compiled = _compiled(_stage())
    x, grad_out = _data()
    compiled(x.clone().requires_grad_()).backward(grad_out)  # compile outside the count
    runs = []
    x = x.clone().requires_grad_()
    out = compiled(x)
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            node.register_prehook(lambda grads, node=node: runs.append(node) and None)
        stack += [child for child, _ in node.next_functions]
    _, state = backward_input([out], [grad_out], [x])
    assert len(runs) == 2  # I ran both compiled blocks
    backward_weight(state)
    assert len(runs) == 2, "W ran a compiled backward again"
