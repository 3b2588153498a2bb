"""Activation checkpointing chosen per stage with the split (pure planning, synthetic profiles):
under a cap no AC-free plan fits, the early stages (many microbatches in flight) recompute and
the late ones do not; the user's setting is a constraint; the plan objects carry it."""

import dataclasses

import pytest

from pp_core import ConfigError
from pp_core.planning.choose import choose_plan
from pp_core.planning.costs import ModelProfile, UnitCost
from pp_core.planning.recompute import Recompute, balance_by_mode, choose_modes, with_modes
from pp_core.planning.report import format_ranking
from pp_core.plugin_manager import default_plugins
from pp_core.schedule.build import resolve_schedule_def

MiB = 2 ** 20


def block(i, mbs, weight=1.0):
    f = weight * mbs * 1e-3
    saved = int(4 * weight * mbs * MiB)
    return UnitCost(fqns=(f"layers.{i}",), forward_s=f, backward_s=2 * f, input_grad_s=f,
                    weight_grad_s=f, activation_bytes=saved, param_bytes=MiB // 4,
                    output_bytes=mbs * 64 * 1024,
                    recompute=(("full", f, 3 * f, 2 * f, mbs * 64 * 1024, saved),
                               ("selective", f, 2.3 * f, 1.3 * f, saved // 2, saved // 2)))


def profile(mbs, num_blocks=8):
    return ModelProfile(mbs, tuple(block(i, mbs) for i in range(num_blocks)),
                        p2p_latency_s=1e-5, p2p_bytes_per_s=1e9,
                        optimizer_step_bytes_per_param_byte=0.0)


PROFILES = {m: profile(m) for m in (1, 2)}


def only(*names):
    plugins = default_plugins()
    return {name: resolve_schedule_def(name, plugins)[1] for name in names}


def cap_between(schedules, pp=2, batch=8):
    """A cap below every AC-free plan's peak (by a margin) that recomputing fits under."""
    free = choose_plan(PROFILES, pp, batch, only(*schedules))
    lowest = min(c.peak_bytes for c in free.kept)
    return int(lowest * 0.85)


def test_under_a_cap_no_ac_free_plan_fits_the_early_stages_recompute_and_late_ones_do_not():
    cap = cap_between(["1f1b"], pp=4)
    assert not choose_plan(PROFILES, 4, 8, only("1f1b"), memory_cap=cap).kept
    ranking = choose_plan(PROFILES, 4, 8, only("1f1b"), memory_cap=cap,
                          activation_checkpointing="auto")
    chosen = ranking.chosen
    modes = chosen.activation_checkpointing
    assert chosen.peak_bytes <= cap
    assert modes[0] != "none" and modes[-1] == "none", modes
    order = ["none", "selective", "full"]
    assert [order.index(m) for m in modes] == sorted((order.index(m) for m in modes),
                                                     reverse=True)  # earlier: more recompute
    uniform = choose_plan(PROFILES, 4, 8, only("1f1b"), memory_cap=cap,
                          activation_checkpointing="full").chosen
    assert uniform.activation_checkpointing == ["full"] * 4
    assert chosen.predicted_step_s < uniform.predicted_step_s
    assert "AC" in format_ranking(ranking) and "per stage" in format_ranking(ranking)


def test_the_split_moves_units_toward_the_stages_that_do_not_recompute():
    counts = balance_by_mode(PROFILES[1], 4, ["full", "full", "none", "none"])
    assert sum(counts) == 8 and counts[0] <= counts[-1] and counts[1] <= counts[2]
    assert balance_by_mode(PROFILES[1], 4, ["none"] * 4) == [2, 2, 2, 2]


def test_without_a_cap_nothing_recomputes_and_a_written_mode_is_a_constraint():
    free = choose_plan(PROFILES, 2, 8, only("1f1b"), activation_checkpointing="auto")
    assert all(set(c.activation_checkpointing) == {"none"} for c in free.kept)
    fixed = choose_plan(PROFILES, 2, 8, only("1f1b"), activation_checkpointing="selective")
    assert all(c.activation_checkpointing == ["selective"] * 2 for c in fixed.kept)
    listed = choose_plan(PROFILES, 2, 8, only("1f1b", "interleaved_1f1b"),
                         activation_checkpointing=["full", "none"])
    assert {c.option.schedule for c in listed.kept} == {"1f1b"}
    assert any("names 2 stages, this plan has 4" in (c.dropped or "") for c in listed.dropped)


def test_every_plan_object_carries_the_degrees_and_ac_per_stage():
    ranking = choose_plan(PROFILES, 2, 8, only("1f1b"), activation_checkpointing="auto",
                          degrees={"dp_shard": 2})
    data = ranking.to_dict()
    for plan in [data["chosen"], *data["kept"]]:
        assert plan["activation_checkpointing"] == ["none", "none"]
        assert {k: plan[k] for k in ("pp_size", "dp_replicate", "dp_shard", "tp_size",
                                     "ep_size")} == {"pp_size": 2, "dp_replicate": 1,
                                                     "dp_shard": 2, "tp_size": 1, "ep_size": 1}
    plain = choose_plan(PROFILES, 2, 8, only("1f1b")).to_dict()["chosen"]
    assert plain["activation_checkpointing"] == ["none", "none"] and plain["pp_size"] == 2


def test_choose_modes_fits_or_goes_as_far_as_it_can():
    from pp_core.schedule.build import schedule_from_def

    schedule = schedule_from_def("1f1b", only("1f1b")["1f1b"], num_ranks=2, num_microbatches=8)
    units = [[0, 1, 2, 3], [4, 5, 6, 7]]
    modes = choose_modes(schedule, PROFILES[1], units, Recompute("auto", cap=1))
    assert modes == ["full", "full"]  # nothing fits: as far as it goes, the cap then drops it
    assert with_modes(PROFILES[1], units, modes).units[0].activation_bytes == 64 * 1024
    with pytest.raises(ConfigError, match="no plan fits memory_cap"):
        choose_plan(PROFILES, 2, 8, only("1f1b"), memory_cap=1,
                    activation_checkpointing="auto").chosen


def test_a_profile_with_recompute_round_trips_through_plain_data():
    again = ModelProfile.from_dict(PROFILES[1].to_dict())
    assert again == PROFILES[1] and again.units[0].modes() == ("none", "full", "selective")
    with pytest.raises(ValueError, match="no measured activation checkpointing mode"):
        UnitCost(("x",), 0, 0, 0, 0, 0, 0, 0).under("full")


@pytest.mark.parametrize("pp", [2, 4])
def test_choosing_per_stage_is_never_predicted_slower_than_every_stage_full(pp):
    """``auto`` may run every stage ``full`` on the cut a uniform setting gets, so under any cap
    its choice is at least as fast as the uniform plan (it was up to 1.05x slower when it only
    tried the cuts balanced for its own modes, and 1.11x when it picked ``selective`` by its
    recompute alone while its forward, slower than the plain one, made the step slower)."""
    def dear_selective(u):  # selective's forward three times the plain one
        return dataclasses.replace(u, recompute=(u.recompute[0], (
            "selective", 3 * u.forward_s, 2.3 * u.forward_s, 1.3 * u.forward_s,
            *u.recompute[1][4:])))

    dear = {m: dataclasses.replace(p, units=tuple(dear_selective(u) for u in p.units))
            for m, p in PROFILES.items()}
    free = choose_plan(dear, pp, 8)
    lowest = min(c.peak_bytes for c in free.kept)
    for fraction in (0.95, 0.85, 0.75, 0.65, 0.55, 0.45):
        cap = int(lowest * fraction)
        uniform = choose_plan(dear, pp, 8, memory_cap=cap, activation_checkpointing="full")
        chosen = choose_plan(dear, pp, 8, memory_cap=cap, activation_checkpointing="auto")
        if uniform.kept:
            assert chosen.chosen.predicted_step_s <= uniform.chosen.predicted_step_s * (1 + 1e-9), \
                (fraction, format_ranking(chosen, top=2), format_ranking(uniform, top=2))
