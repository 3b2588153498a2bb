"""What a cross-rank hand-off costs the ranks in the planner's simulation (pure, synthetic
profiles): the send and receive busy time lands on the actions that move data between ranks,
never on a hand-off between two stages of one rank (V placements), and the executor's own time
on every action."""

import dataclasses

import pytest

from pp_core.planning.costs import Link, ModelProfile, UnitCost
from pp_core.planning.refine import handoff_charges, simulate_split
from pp_core.schedule.build import build_schedule

M = 4


def profile(**link):
    units = tuple(UnitCost(fqns=(f"layers.{i}",), forward_s=1e-3, backward_s=2e-3,
                           input_grad_s=1e-3, weight_grad_s=1e-3, activation_bytes=1,
                           param_bytes=4, output_bytes=1000 * (i + 1)) for i in range(8))
    return ModelProfile(2, units, p2p_latency_s=1e-5, p2p_bytes_per_s=1e9, **link)


def units_of(num_stages):
    per = 8 // num_stages
    return [list(range(s * per, (s + 1) * per)) for s in range(num_stages)]


def cross_boundaries(schedule, rank):
    """Brute force: boundaries ``(s, s + 1)`` on different ranks that touch ``rank``."""
    ranks = schedule.stage_ranks
    return sum(1 for s in range(len(ranks) - 1)
               if ranks[s] != ranks[s + 1] and rank in (ranks[s], ranks[s + 1]))


@pytest.mark.parametrize("name,stages_per_rank", [
    ("1f1b", 1), ("interleaved_1f1b", 2), ("dfs", 2), ("v_half", 2), ("dualpipe_v", 2),
    ("zero_bubble", 1)])
def test_busy_time_grows_by_the_cross_rank_hand_offs_only(name, stages_per_rank):
    schedule = build_schedule(name, num_ranks=2, num_microbatches=M,
                              stages_per_rank=stages_per_rank)
    units = units_of(schedule.num_stages)
    plain = simulate_split(schedule, profile(), units)
    send, recv = 3e-4, 5e-4
    charged = simulate_split(schedule, profile(p2p_send_busy_s=send, p2p_recv_busy_s=recv),
                             units)
    for rank in range(2):
        # every cross boundary: one side sends in F and receives in B (or I), the other the
        # reverse, once per microbatch
        expected = M * (send + recv) * cross_boundaries(schedule, rank)
        assert charged.busy[rank] - plain.busy[rank] == pytest.approx(expected, rel=1e-9)
    assert charged.makespan > plain.makespan


def test_a_v_placement_hands_over_between_its_own_stages_for_free():
    schedule = build_schedule("v_half", num_ranks=2, num_microbatches=M, stages_per_rank=2)
    assert list(schedule.stage_ranks) == [0, 1, 1, 0]
    charges = handoff_charges(schedule, profile(p2p_send_busy_s=1.0, p2p_recv_busy_s=10.0),
                              units_of(4))
    assert [c["F"] for c in charges] == [1.0, 10.0, 1.0, 10.0]   # 1 -> 2 is on rank 1: free
    assert [c["B"] for c in charges] == [10.0, 1.0, 10.0, 1.0]
    assert [c["I"] for c in charges] == [c["B"] for c in charges]
    assert [c["W"] for c in charges] == [0.0] * 4


def test_the_message_size_is_the_boundary_it_moves():
    schedule = build_schedule("interleaved_1f1b", num_ranks=2, num_microbatches=M,
                              stages_per_rank=2)
    units = units_of(4)  # stage s hands on unit 2s+1's output: 2000, 4000, 6000 bytes
    charges = handoff_charges(schedule, profile(p2p_busy_bytes_per_s=1000.0), units)
    assert [c["F"] for c in charges] == [2.0, 2.0 + 4.0, 4.0 + 6.0, 6.0]
    assert [c["B"] for c in charges] == [c["F"] for c in charges]


def test_executor_overhead_is_paid_by_every_action():
    schedule = build_schedule("zero_bubble", num_ranks=2, num_microbatches=M)
    units = units_of(2)
    plain = simulate_split(schedule, profile(), units)
    charged = simulate_split(schedule, profile(action_overhead_s=1e-4), units)
    for rank in range(2):
        actions = sum(1 for a in schedule.actions[rank] if a is not None)  # F, I, W each
        assert charged.busy[rank] - plain.busy[rank] == pytest.approx(actions * 1e-4)


def test_unmeasured_profiles_predict_as_before_and_round_trip():
    schedule = build_schedule("dfs", num_ranks=2, num_microbatches=M, stages_per_rank=2)
    assert all(v == 0.0 for c in handoff_charges(schedule, profile(), units_of(4))
               for v in c.values())
    measured = profile(p2p_send_busy_s=1e-4, p2p_recv_busy_s=2e-4, p2p_busy_bytes_per_s=1e9,
                       action_overhead_s=3e-5)
    assert ModelProfile.from_dict(measured.to_dict()) == measured
    new = ("p2p_send_busy_s", "p2p_recv_busy_s", "p2p_busy_bytes_per_s", "action_overhead_s")
    old = {k: v for k, v in measured.to_dict().items() if k not in new}
    assert ModelProfile.from_dict(old) == dataclasses.replace(
        measured, p2p_send_busy_s=0.0, p2p_recv_busy_s=0.0,
        p2p_busy_bytes_per_s=float("inf"), action_overhead_s=0.0)


def test_a_link_fills_the_profile_fields_its_figures_name():
    figures = (1e-5, 1e9, 1e-4, 2e-4, 5e8, 3e-5)
    link = Link.of(figures)
    assert dataclasses.astuple(link) == figures and Link.of(link) is link
    # the figures land on the profile's p2p fields, in field order
    assert profile(**{k: v for k, v in link.profile_fields().items()
                      if k not in ("p2p_latency_s", "p2p_bytes_per_s")}) == \
        dataclasses.replace(profile(), p2p_send_busy_s=1e-4, p2p_recv_busy_s=2e-4,
                            p2p_busy_bytes_per_s=5e8, action_overhead_s=3e-5)
    # latency and bandwidth alone: the rest unmeasured, as a profile without them
    short = Link.of((1e-5, 1e9)).profile_fields()
    assert ModelProfile(2, profile().units, **short) == profile()
    assert list(link.to_dict()) == ["latency_s", "bytes_per_s", "send_busy_s", "recv_busy_s",
                                    "busy_bytes_per_s", "action_overhead_s"]
    with pytest.raises(ValueError, match="the first two at least; got 1"):
        Link.of((1e-5,))
