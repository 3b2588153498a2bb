"""The transient peak: what a unit's forward + backward hold only while they run, measured by
the profiler against the analytic size of a vocabulary head, and charged by the memory model
(the largest unit per rank; the optimizer step's temporaries against the activations)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pp_core.planning.costs import ModelProfile, UnitCost
from pp_core.planning.memory import predict_memory
from pp_core.measure.profile import profile_model
from pp_core.measure.transient import Allocations
from pp_core.schedule.build import build_schedule
from pp_core.testing import plugins_with

PLUGINS = plugins_with("pp_core_builtins.splitters.sequential")
N, D, V = 64, 16, 4096
F32 = 4


def test_a_vocabulary_head_holds_two_logit_sized_temporaries_beyond_what_it_saves():
    """Linear into cross-entropy: the forward saves the log-softmax (N x V); the backward holds
    it, its gradient and the logits' gradient at once. Beyond the saved one: two N x V tensors
    and the 4-byte loss. The first unit's only allocation is its output (N x D)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, V))
    x, y = torch.randn(N, D), torch.randint(0, V, (N,))
    profile = profile_model(model, x, y, F.cross_entropy, [N], repeats=1, plugins=PLUGINS)[N]
    body, head = profile.units
    assert head.transient_bytes == 2 * N * V * F32 + F32
    assert body.transient_bytes == N * D * F32
    assert head.activation_bytes >= N * V * F32  # the log-softmax is saved, not transient


def test_allocations_count_a_storage_once_and_leave_out_parameter_gradients():
    log = Allocations()
    with log.tracking():
        made = torch.zeros(1000)
        views = made[:500], made.view(10, 100), made.add_(1)  # the same storage, three times
    assert log.peak() == 1000 * F32
    del made, views
    weight = nn.Parameter(torch.randn(256, 256))
    log = Allocations()
    with log.tracking():
        (torch.ones(8, 256) @ weight).sum().backward()
    assert log.peak() >= 256 * 256 * F32  # the weight's gradient was made inside
    assert log.peak([weight.grad]) < 256 * 256 * F32 // 8


def test_adamw_foreach_step_holds_one_parameter_group_of_temporaries():
    """The figure :attr:`ModelProfile.optimizer_step_bytes_per_param_byte` defaults to."""
    params = [nn.Parameter(torch.randn(256, 256)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    optimizer.step()  # the first step makes the state (charged as ``optimizer``)
    log = Allocations()
    with log.tracking():
        optimizer.step()
    total = sum(p.numel() * p.element_size() for p in params)
    assert log.peak() / total == ModelProfile.optimizer_step_bytes_per_param_byte == 1.0


def unit(i, transient, params=1000):
    return UnitCost((f"{i}",), 1e-3, 2e-3, 1e-3, 1e-3, activation_bytes=100, param_bytes=params,
                    output_bytes=10, transient_bytes=transient)


def test_each_rank_is_charged_its_largest_unit_transient_or_the_optimizer_step():
    profile = ModelProfile(1, (unit(0, 50), unit(1, 70), unit(2, 0), unit(3, 9000)), 0.0, 1e9,
                           optimizer_step_bytes_per_param_byte=0.5)
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2, stages_per_rank=1)
    first, last = predict_memory(profile, schedule, [[0, 1], [2, 3]], [200.0, 100.0])
    assert (first.transient, last.transient) == (70, 9000)
    assert (first.optimizer_step, last.optimizer_step) == (1000, 1000)
    base = 2000 + 2000 + 4000  # params, grads, AdamW moments
    # rank 0: the step's temporaries (1000) outweigh activations + receives + transient
    assert first.total(False) == base + max(200 + first.recv_default + 70, 1000)
    # rank 1 also holds the gradient it sent back until the step's end (nothing acknowledges
    # the last one): 10 bytes, its boundary's size
    assert last.sent == 10
    assert last.total(False) == base + 100 + last.recv_default + 9000 + 10
    assert last.to_dict(False)["transient"] == 9000


def test_a_profile_stored_before_transients_loads_with_none():
    data = ModelProfile(1, (unit(0, 5),), 0.0, 1e9).to_dict()
    for stored in data["units"]:
        del stored["transient_bytes"]
    del data["optimizer_step_bytes_per_param_byte"]
    assert ModelProfile.from_dict(data).units[0].transient_bytes == 0
