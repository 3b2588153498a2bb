"""The split backward (I then W) gives exactly the full backward's gradients, on awkward graphs:
shared weights, several outputs, outputs that do not depend on the inputs, unused inputs,
pass-through outputs, integer inputs, frozen parameters, checkpointing, a first stage."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pp_core.runtime.backward import backward_full, backward_input, backward_weight


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return self.b(torch.relu(self.a(self.norm(x)))) + x


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(6, 6)

    def forward(self, x):
        return self.w(torch.tanh(self.w(x)))


class TwoOutputs(nn.Module):
    """Second output depends only on a parameter; first input partly unused; int input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bias = nn.Parameter(torch.randn(6))
        self.frozen = nn.Linear(6, 6).requires_grad_(False)

    def forward(self, x, unused, ids):
        h = self.frozen(self.lin(x)) + ids.float().unsqueeze(-1)
        return h, self.bias * 2 + 1, x


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Chain()

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


class FirstStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.lin = nn.Linear(6, 6)

    def forward(self, ids):
        return self.lin(self.embed(ids))


def _inputs(model):
    g = torch.Generator().manual_seed(0)
    if isinstance(model, TwoOutputs):
        return [torch.randn(4, 6, generator=g).requires_grad_(),
                torch.randn(4, 6, generator=g).requires_grad_(), torch.arange(4)]
    if isinstance(model, FirstStage):
        return [torch.randint(0, 10, (4,), generator=g)]
    return [torch.randn(4, 6, generator=g).requires_grad_()]


def _run(model, split: bool, accumulate_twice: bool):
    inputs = [t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() else t
              for t in _inputs(model)]
    results = []
    for _ in range(2 if accumulate_twice else 1):
        outs = model(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        needs = [o for o in outs if o.requires_grad]
        g = torch.Generator().manual_seed(1)
        grads = [torch.randn(o.shape, generator=g) for o in needs]
        wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        if split:
            input_grads, state = backward_input(needs, grads, wanted)
            backward_weight(state)
        else:
            input_grads = backward_full(needs, grads, wanted)
        results.append(input_grads)
    return results


@pytest.mark.parametrize("factory", [Chain, Shared, TwoOutputs, Checkpointed, FirstStage])
def test_input_then_weight_equals_full_backward(factory):
    torch.manual_seed(0)
    full = factory()
    split = copy.deepcopy(full)
    want_inputs = _run(full, split=False, accumulate_twice=True)
    got_inputs = _run(split, split=True, accumulate_twice=True)
    for want, got in zip(want_inputs, got_inputs):
        assert len(want) == len(got)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    for (name, p_full), (_, p_split) in zip(full.named_parameters(), split.named_parameters()):
        if not p_full.requires_grad:
            assert p_split.grad is None, name
            continue
        torch.testing.assert_close(p_split.grad, p_full.grad, atol=1e-6, rtol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_weight_pass_does_not_recompute_input_gradients():
    """W runs no input-side node again: count the matmuls of each pass on a chain of linears."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(4)])
    x = torch.randn(3, 8, requires_grad=True)
    y = model(x)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof_i:
        _, state = backward_input([y], [torch.ones_like(y)], [x])
    with profile(activities=[ProfilerActivity.CPU]) as prof_w:
        backward_weight(state)

    def matmuls(prof):
        return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))

    assert matmuls(prof_i) == 4  # one dX per layer
    assert matmuls(prof_w) == 4  # one dW per layer, no dX again
