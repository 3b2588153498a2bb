"""The optimizer step in the predicted step: the rank that trains the most bytes, at the
measured rate, and the most tensors at the per-tensor one (a data-parallel engine's DTensors),
slowed by the processors the ranks share (every rank steps at once); frozen bytes cost nothing;
a profile without the rate predicts as before. And the rate itself: measured on copies, the
model untouched."""

import dataclasses

import pytest
import torch

from pp_core.measure.optimizer_step import measure_optimizer_rate
from pp_core.planning.choose import Option, predict
from pp_core.planning.costs import ModelProfile, UnitCost
from pp_core.planning.refine import optimizer_step_s, simulate_split
from pp_core.plugin_manager import default_plugins
from pp_core.schedule.build import build_schedule, resolve_schedule_def

RATE = 1e-9  # seconds per trained byte


def profile(param_bytes=(1000, 3000, 2000, 8000), trainable=(None,) * 4, tensors=(0,) * 4,
            **extra):
    units = tuple(UnitCost(fqns=(f"layers.{i}",), forward_s=1e-3, backward_s=2e-3,
                           input_grad_s=1e-3, weight_grad_s=1e-3, activation_bytes=1,
                           param_bytes=b, output_bytes=100, trainable_param_bytes=t,
                           trained_tensors=n)
                  for i, (b, t, n) in enumerate(zip(param_bytes, trainable, tensors)))
    return ModelProfile(2, units, p2p_latency_s=1e-5, p2p_bytes_per_s=1e9,
                        optimizer_s_per_param_byte=RATE, **extra)


@pytest.mark.parametrize("name, stages_per_rank, expected_bytes", [
    ("1f1b", 1, 10000),           # stages [0, 1] [2, 3]: rank 1 trains 2000 + 8000
    ("interleaved_1f1b", 2, 11000),  # stages 0, 2 on rank 0: 1000 + 2000; 1, 3: 3000 + 8000
    ("v_half", 2, 9000),          # V: rank 0 holds stages 0 and 3 (1000 + 8000), rank 1 3000 + 2000
])
def test_the_slowest_rank_steps_its_stages_bytes(name, stages_per_rank, expected_bytes):
    schedule = build_schedule(name, num_ranks=2, num_microbatches=4,
                              stages_per_rank=stages_per_rank)
    units = [[0, 1], [2, 3]] if stages_per_rank == 1 else [[0], [1], [2], [3]]
    assert optimizer_step_s(schedule, profile(), units) == pytest.approx(expected_bytes * RATE)


def test_shared_processors_slow_it_and_frozen_bytes_cost_nothing():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    units = [[0, 1], [2, 3]]
    shared = profile(processors=1.0)  # two ranks on one processor: each steps at half speed
    assert optimizer_step_s(schedule, shared, units) == pytest.approx(2 * 10000 * RATE)
    frozen = profile(trainable=(None, None, 0, 500))  # LoRA-like: the last stage trains 500
    assert optimizer_step_s(schedule, frozen, units) == pytest.approx(4000 * RATE)
    unmeasured = dataclasses.replace(profile(), optimizer_s_per_param_byte=0.0)
    assert optimizer_step_s(schedule, unmeasured, units) == 0.0


def test_each_trained_tensor_costs_the_per_tensor_time_on_top():
    """Rank 0: 4000 bytes in 30 tensors; rank 1: 10000 bytes in 2. At 1e-4 s a tensor rank 0
    is the slower one: 4000 * RATE + 30e-4 against 10000 * RATE + 2e-4."""
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    counted = profile(tensors=(10, 20, 1, 1), optimizer_s_per_tensor=1e-4)
    assert optimizer_step_s(schedule, counted, [[0, 1], [2, 3]]) == \
        pytest.approx(4000 * RATE + 30e-4)
    assert optimizer_step_s(schedule, profile(tensors=(10, 20, 1, 1)), [[0, 1], [2, 3]]) == \
        pytest.approx(10000 * RATE)  # no per-tensor time: as before


def test_the_predicted_step_is_the_makespan_plus_the_step():
    plugins = default_plugins()
    sdef = resolve_schedule_def("1f1b", plugins)[1]
    fqns = [["layers.0", "layers.1"], ["layers.2", "layers.3"]]
    candidate = predict(Option("1f1b", 1, 2, 4), sdef, profile(), 2, fqns)
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    makespan = simulate_split(schedule, profile(), [[0, 1], [2, 3]]).makespan
    assert candidate.optimizer_step_s == pytest.approx(10000 * RATE)
    assert candidate.predicted_step_s == pytest.approx(makespan + 10000 * RATE)
    assert candidate.to_dict()["optimizer_step_s"] == candidate.optimizer_step_s
    assert ModelProfile.from_dict(profile().to_dict()) == profile()


def test_the_rate_is_measured_on_copies_and_scales_with_the_bytes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    model[1].requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    rate = measure_optimizer_rate(model)
    assert rate > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert measure_optimizer_rate(model.requires_grad_(False)) == 0.0
