"""The planner's choice on synthetic profiles: enumeration, the memory cap, third-party
schedules, ranking, the memory model against the buffer planner, and size parsing."""

import pytest

from pp_core import Action, B, ConfigError, F, hookimpl
from pp_core.planning.choose import choose_plan
from pp_core.planning.report import format_ranking
from pp_core.planning.sizes import format_bytes, parse_size
from pp_core.plugin_manager import load_plugins
from pp_core.schedule.buffer_plan import plan_program
from pp_core.schedule.build import build_schedule, resolve_schedule_def
from pp_core.schedule.ir import RECV_F
from pp_core.schedule.lower import lower
from tests.cases.profiles import MiB, PROFILES, profile

def one_f_one_b_by_hand(num_stages, num_microbatches, num_ranks):
    """A third party's schedule: 1F1B written out (warm-up forwards, then F/B pairs)."""
    rows = []
    for r in range(num_ranks):
        warm = min(num_ranks - 1 - r, num_microbatches)
        row = [Action(r, F, k) for k in range(warm)]
        for k in range(warm, num_microbatches):
            row += [Action(r, F, k), Action(r, B, k - warm)]
        row += [Action(r, B, k) for k in range(num_microbatches - warm, num_microbatches)]
        rows.append(row)
    return rows


class ThirdParty:
    @hookimpl
    def pp_register_schedules(self, register):
        register("by_hand_1f1b", one_f_one_b_by_hand)


def test_every_installed_schedule_is_enumerated_and_kept_ones_are_sorted_by_time():
    ranking = choose_plan(PROFILES, 2, 8)
    seen = {c.option.schedule for c in ranking.kept + ranking.dropped}
    assert seen == set(load_plugins().schedules.names())
    times = [c.predicted_step_s for c in ranking.kept]
    assert times == sorted(times) and ranking.chosen is ranking.kept[0]
    sizes = {c.option.microbatch_size for c in ranking.kept}
    assert sizes == {1, 2, 4}  # every profiled divisor of 8
    looped = {c.option.stages_per_rank for c in ranking.kept + ranking.dropped
              if c.option.schedule == "interleaved_1f1b"}
    assert looped == {2, 3, 4}


def test_more_stages_than_units_and_refused_sizes_are_dropped_with_the_reason():
    ranking = choose_plan(PROFILES, 4, 8)  # 4 ranks x 3 stages = 12 > 8 units
    reasons = {(c.option.schedule, c.option.stages_per_rank): c.dropped for c in ranking.dropped}
    assert "needs 12 stages, the model has 8 units" in reasons[("interleaved_1f1b", 3)]
    assert any("refuses these sizes" in (c.dropped or "") for c in ranking.dropped)


def test_a_third_party_schedule_competes_and_wins_under_the_cap():
    plugins = load_plugins(plugins=[ThirdParty()])
    ranking = choose_plan(PROFILES, 2, 8, plugins.schedules)
    ours = [c for c in ranking.kept if c.option.schedule == "by_hand_1f1b"]
    builtin = {(c.option.microbatch_size): c for c in ranking.kept if c.option.schedule == "1f1b"}
    assert len(ours) == 3
    for c in ours:  # the same order as the built-in 1F1B: the same prediction
        assert c.predicted_step_s == pytest.approx(builtin[c.option.microbatch_size]
                                                   .predicted_step_s)
    schedules = {"gpipe": resolve_schedule_def("gpipe", plugins)[1],
                 "by_hand_1f1b": resolve_schedule_def("by_hand_1f1b", plugins)[1]}
    free = choose_plan(PROFILES, 2, 8, schedules)
    gpipe_peak = min(c.peak_bytes for c in free.kept if c.option.schedule == "gpipe"
                     and c.option.microbatch_size == 1)
    ours_peak = min(c.peak_bytes for c in free.kept if c.option.schedule == "by_hand_1f1b")
    assert ours_peak < gpipe_peak
    capped = choose_plan(PROFILES, 2, 8, schedules, memory_cap=ours_peak)
    assert capped.chosen.option.schedule == "by_hand_1f1b"
    assert all(c.peak_bytes <= ours_peak for c in capped.kept)
    assert all("memory cap" in c.dropped for c in capped.dropped if c.predicted_step_s)


def test_the_cap_drops_the_fastest_plan_and_the_table_says_what_was_given_up():
    free = choose_plan(PROFILES, 2, 8)
    fastest = free.chosen
    cap = fastest.peak_bytes - 1
    capped = choose_plan(PROFILES, 2, 8, memory_cap=cap)
    assert all(c.peak_bytes <= cap for c in capped.kept)
    assert capped.chosen.predicted_step_s >= fastest.predicted_step_s
    assert fastest.option in {c.option for c in capped.gave_up()}
    text = format_ranking(capped)
    assert "faster plans dropped:" in text and f"> memory cap {format_bytes(cap)}" in text
    assert capped.to_dict()["chosen"]["schedule"] == capped.chosen.option.schedule


def test_nothing_fits_names_the_smallest_peak_and_the_fix():
    ranking = choose_plan(PROFILES, 2, 8, memory_cap=1024)
    assert not ranking.kept
    with pytest.raises(ConfigError, match=r"no plan fits memory_cap=1.0 KiB per rank: the "
                                          r"smallest predicted peak is .* raise the cap"):
        ranking.chosen


def test_the_pool_is_turned_on_only_when_it_makes_a_plan_fit():
    free = choose_plan(PROFILES, 2, 8, recv_buffer_pool=None)
    assert not any(c.pool for c in free.kept)
    gpipe = next(c for c in free.kept if c.option.schedule == "gpipe"
                 and c.option.microbatch_size == 1)
    without = max(m.total(False) for m in gpipe.memory)
    with_pool = max(m.total(True) for m in gpipe.memory)
    assert with_pool < without  # gpipe holds every microbatch's input until its backward
    gpipe = resolve_schedule_def("gpipe", load_plugins())[1]
    capped = choose_plan(PROFILES, 2, 8, {"gpipe": gpipe},
                         memory_cap=with_pool)
    chosen = next(c for c in capped.kept if c.option.microbatch_size == 1)
    assert chosen.pool and chosen.peak_bytes == with_pool


@pytest.mark.parametrize("name", ["1f1b", "zero_bubble", "interleaved_1f1b", "v_schedule"])
def test_receive_buffer_bytes_match_the_buffer_planner(name):
    ranking = choose_plan(PROFILES, 2, 8, {name: resolve_schedule_def(name, load_plugins())[1]})
    candidate = next(c for c in ranking.kept if c.option.microbatch_size == 2)
    schedule = build_schedule(name, num_ranks=2, num_microbatches=4,
                              stages_per_rank=candidate.option.stages_per_rank)
    program = lower(schedule)
    boundary = 2 * 64 * 1024  # every unit hands on mbs * 64 KiB
    # Without the pool a received input lives until its backward is released, a received
    # gradient until the B or I that consumes it (what W still holds of it is
    # memory.split_held_bytes, with the activations). The buffers are counted where they are
    # live beside the activations and the sent gradients: at most every class at its own peak.
    for released, consumed, pooled, memory in zip(
            plan_program(program, 0, "released"), plan_program(program, 0),
            plan_program(program, 2), candidate.memory):
        inputs = sum(p.sets for c, p in released.classes.items() if c.kind is RECV_F)
        grads = sum(p.sets for c, p in consumed.classes.items() if c.kind is not RECV_F)
        assert 0 < memory.recv_default <= boundary * (inputs + grads)
        assert memory.recv_pool == boundary * sum(p.sets for p in pooled.classes.values())


def test_receive_buffers_are_counted_action_by_action():
    """1f1b, 2 ranks, 3 microbatches (test_lower's exact program). Rank 1 (F0 B0 F1 B1 F2
    B2) holds a received input from its RECV_F through the B that releases it; rank 0 (F0 F1
    B0 F2 B1 B2) a gradient from its RECV_B through the B that consumes it. As gloo posts them
    (early): a gradient from the forward whose output it is for, every input from the start."""
    from pp_core.planning.memory import recv_bytes_per_action

    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    inputs = [10, 20, 10, 20, 10, 10]
    assert recv_bytes_per_action(schedule, [10, 0]) == [[0, 0, 10, 0, 10, 10], inputs]
    assert recv_bytes_per_action(schedule, [10, 0], early=True) == [
        [0, 10, 20, 10, 20, 10], [30, 30, 20, 20, 10, 10]]
    # a stage whose first unit keeps its input (saved for backward) holds the buffer as an
    # activation after its forward: counted here only up to it
    assert recv_bytes_per_action(schedule, [10, 0], kept=[0, 10])[1] == [10, 10, 10, 10, 10, 0]


def test_a_sent_gradient_is_held_until_the_rank_knows_it_received():
    """Rank 1 of 1f1b, 2 ranks, 3 microbatches: its first gradient (sent after B0) is known
    received at F2, whose input rank 0 sent after consuming it; the second has no later
    message and is held to the end; the third is sent after rank 1's last compute."""
    from pp_core.planning.memory import sent_bytes_per_action

    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=3)
    assert sent_bytes_per_action(schedule, [10, 0]) == [[0] * 6, [0, 0, 10, 10, 20, 10]]


def test_memory_parts_add_up_from_the_units_of_each_rank():
    one_f_one_b = resolve_schedule_def("1f1b", load_plugins())[1]
    ranking = choose_plan(PROFILES, 2, 8, {"1f1b": one_f_one_b})
    candidate = next(c for c in ranking.kept if c.option.microbatch_size == 1)
    units = {u.fqns[0]: u for u in PROFILES[1].units}
    for rank, memory in enumerate(candidate.memory):
        params = sum(units[f].param_bytes for f in candidate.fqns_per_stage[rank])
        assert (memory.params, memory.grads, memory.optimizer) == (params, params, 2 * params)
    # 1F1B: rank 0 keeps 2 microbatches in flight (pp=2), the last rank 1; a stage that is
    # not the last keeps its outputs for its backward too
    first = sum(units[f].activation_bytes for f in candidate.fqns_per_stage[0])
    outputs = units[candidate.fqns_per_stage[0][-1]].output_bytes
    assert candidate.memory[0].activations == 2 * (first + outputs)


def test_no_profiled_size_divides_the_batch():
    with pytest.raises(ConfigError, match=r"no profiled microbatch size divides "
                                          r"pp_batch_size=7"):
        choose_plan({2: PROFILES[2], 4: PROFILES[4]}, 2, 7)


@pytest.mark.parametrize("text, size", [("512MiB", 512 * MiB), ("8GiB", 8 * 2 ** 30),
                                        ("1.5GB", 1_500_000_000), ("1000", 1000),
                                        ("2 kib", 2048), (4096, 4096)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["8 gigs", "GiB", "-1GiB", "0", "", "1e9"])
def test_parse_size_refuses_with_the_units_it_takes(text):
    with pytest.raises(ConfigError, match=r"--memory-cap=.*(512MiB, 8GiB|more than 0)"):
        parse_size(text)


def test_default_microbatch_sizes_keep_every_rank_busy():
    from pp_core.measure.plan_auto import default_microbatch_sizes

    assert default_microbatch_sizes(16, 2) == [1, 2, 4, 8]
    assert default_microbatch_sizes(16, 4) == [1, 2, 4]
    assert default_microbatch_sizes(12, 2, limit=3) == [1, 2, 3]
    assert default_microbatch_sizes(2, 4) == [1]


def test_concrete_config_is_what_build_pipeline_runs():
    from pp_core import PipelineConfig
    from pp_core.measure.plan_auto import concrete_config

    ranking = choose_plan(PROFILES, 2, 8, memory_cap=None)
    chosen = ranking.chosen
    config = concrete_config(PipelineConfig(pp_schedule="auto", pp_batch_size=8,
                                            loss_fn="cross_entropy"), chosen)
    assert config.pp_schedule == chosen.option.schedule
    assert config.pp_microbatch_size == chosen.option.microbatch_size
    assert config.module_fqns_per_model_part == chosen.fqns_per_stage
    assert [f for stage in chosen.fqns_per_stage for f in stage] == \
        [f"layers.{i}" for i in range(8)]


def test_refining_the_cuts_never_predicts_slower_and_ends_at_a_local_optimum():
    from pp_core.planning.refine import makespan_of, refine_counts

    plugins = load_plugins()
    uneven = profile(2, weights=(6, 1, 1, 1, 1, 1, 1, 1, 1, 6))
    for name in ("v_schedule", "interleaved_1f1b", "1f1b"):
        sdef = resolve_schedule_def(name, plugins)[1]
        v = 2 if sdef.variable_stages_per_rank else sdef.stages_per_rank
        schedule = build_schedule(name, num_ranks=2, num_microbatches=4, stages_per_rank=v)
        start = [1] * (2 * v - 1) + [10 - (2 * v - 1)]  # a poor split to start from
        counts, seconds = refine_counts(schedule, uneven, start)
        assert sum(counts) == 10 and min(counts) >= 1
        assert seconds == pytest.approx(makespan_of(schedule, uneven, counts))
        assert seconds < makespan_of(schedule, uneven, start)
        for cut in range(len(counts) - 1):  # no single move of one unit does better
            for shift in (-1, 1):
                trial = list(counts)
                trial[cut] += shift
                trial[cut + 1] -= shift
                if min(trial) >= 1:
                    assert makespan_of(schedule, uneven, trial) >= seconds * (1 - 1e-9)


def test_refined_plans_are_never_predicted_slower_than_the_balanced_split():
    uneven = {m: profile(m, weights=(6, 1, 1, 2, 2, 1, 1, 6)) for m in (1, 2)}
    plain = choose_plan(uneven, 2, 4, refine_top=0)
    refined = choose_plan(uneven, 2, 4, refine_top=len(plain.kept))
    assert refined.chosen.predicted_step_s <= plain.chosen.predicted_step_s
    by_option = {c.option: c for c in plain.kept}
    moved = [c for c in refined.kept if c.fqns_per_stage != by_option[c.option].fqns_per_stage]
    assert moved  # the simulator found better cuts for some plans
    for c in moved:
        assert c.predicted_step_s < by_option[c.option].predicted_step_s


def test_ranks_sharing_processors_are_predicted_at_least_their_work_over_the_processors():
    """4 one-thread CPU ranks on 2 cores: no plan can beat the total work over 2, which a
    processor per rank ignores; the planner's prediction says so for every plan."""
    import dataclasses

    own = choose_plan(PROFILES, 4, 8, refine_top=0)
    shared = choose_plan({m: dataclasses.replace(p, processors=2.0)
                          for m, p in PROFILES.items()}, 4, 8, refine_top=0)
    by_label = {c.option: c for c in own.kept}
    assert {c.option for c in shared.kept} == set(by_label)
    work = {m: sum(u.forward_s + u.backward_s for u in p.units) for m, p in PROFILES.items()}
    for candidate in shared.kept:
        option = candidate.option
        assert candidate.predicted_step_s >= by_label[option].predicted_step_s - 1e-12
        assert candidate.predicted_step_s >= \
            0.999 * work[option.microbatch_size] * option.num_microbatches / 2


def test_a_refined_split_the_cap_refuses_is_said_to_be_given_up():
    """Refining v_schedule's cuts here is faster but needs more memory than the balanced split;
    under a cap between the two the balanced split runs and the table names the refined one."""
    profiles = {m: profile(m, (3, 2, 1, 1, 8, 3, 2, 8, 2, 3)) for m in (1, 2)}
    free = choose_plan(profiles, 3, 8).chosen
    balanced = {c.option: c for c in choose_plan(profiles, 3, 8, refine_top=0).kept}[free.option]
    assert free.peak_bytes > balanced.peak_bytes
    capped = choose_plan(profiles, 3, 8, memory_cap=balanced.peak_bytes)
    given_up = [c for c in capped.gave_up() if c.option == free.option]
    assert given_up and given_up[0].dropped.startswith("its simulator-refined split: predicted")
    assert "simulator-refined split" in format_ranking(capped)
