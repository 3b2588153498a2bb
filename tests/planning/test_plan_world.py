"""``pp-core plan FILE --world N``: every layout of N processes the model admits, ranked; the
dropped ones with their reason; the JSON contract; the chosen layout written and run; bad input
refused in one line before anything is measured."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from pp_core.app import cli
from pp_core.app.plan.plan_world import WorldPlan
from pp_core.app.plan.timed_layouts import BOUNDS
from pp_core.app.spec import apply_overrides
from pp_core.errors import ConfigError
from pp_core.measure.layouts import ModelShape, enumerate_layouts
from pp_core.planning.collectives import Collectives, fit, ring_factors

MODEL = {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2, "max_seq_len": 8}
BASE = {
    "model": {"name": "gpt", "args": MODEL},
    "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 32}},
    "pipeline": {"pp_schedule": "auto", "pp_batch_size": 8, "loss_fn": "cross_entropy"},
    "distributed": {"pp_size": 2, "device": "cpu"},
    "train": {"steps": 1, "optimizer": {"name": "AdamW", "lr": 0.01}},
    "output": {"progress": "off", "summary": False},
}
MOE = apply_overrides(BASE, ["model.name=moe_gpt", "model.args.num_experts=4",
                             "model.args.top_k=2"])
DEGREES = ("pp_size", "dp_replicate", "dp_shard", "tp_size", "ep_size")
PLAN_KEYS = {"schedule", "stages_per_rank", "microbatch_size", "num_microbatches",
             "predicted_step_s", "bubble_ratio", "peak_bytes", "memory_per_rank",
             "fqns_per_stage", "activation_checkpointing", *DEGREES}


def _file(tmp_path, values, name="pipe.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values))
    return str(path)


def _fails(argv, capsys) -> str:
    """The error a user sees from a refused command (stderr: one line, no traceback); plan
    prints nothing else."""
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    if argv[0] == "plan":
        assert captured.out == ""
    return captured.err


# ------------------------------------------------------------------ pure: layouts, collectives
def test_layouts_of_4_say_why_each_dropped_one_cannot_run():
    shape = ModelShape(num_units=3, num_heads=2, num_experts=0, global_batch_size=2)
    admitted, dropped = enumerate_layouts(4, shape)
    reasons = {(d.dims.pp, d.dims.dp_replicate, d.dims.dp_shard, d.dims.tp): d.reason
               for d in dropped}
    assert reasons[(4, 1, 1, 1)] == ("pp_size 4 > the model's 3 units (every pipeline rank "
                                     "holds at least one)")
    assert reasons[(1, 1, 1, 4)] == "tp_size 4 does not divide the model's 2 attention heads"
    assert reasons[(1, 4, 1, 1)] == "dp 4 does not divide the global batch of 2 samples"
    every = admitted + [d.dims for d in dropped]
    assert all(d.world_size == 4 for d in every) and len(set(every)) == len(every)
    assert {(d.pp, d.dp, d.tp) for d in admitted} == {(2, 2, 1), (2, 1, 2), (1, 2, 2)}


def test_layouts_with_experts_draw_ep_from_the_dp_ranks():
    shape = ModelShape(num_units=6, num_heads=4, num_experts=2, global_batch_size=8)
    admitted, dropped = enumerate_layouts(8, shape, {"pp_size": 2})
    assert {d.pp for d in admitted} == {2}
    assert any(d.ep == 2 and d.dp == 4 for d in admitted)
    assert {d.reason for d in dropped if d.dims.ep == 4} == \
        {"ep_size 4 does not divide the model's 2 experts"}


@pytest.mark.parametrize("world, fixed, message", [
    (0, None, "--world: expected the number of processes, an int >= 1, found 0"),
    (4, {"tp_size": 3}, "--world 4: the fixed degrees tp_size=3 make 3 processes per layout, "
                        "which does not divide 4; drop a fixed degree or use a --world that 3 "
                        "divides"),
    (4, {"sequence_parallel": True}, "--world searches the degrees pp_size, dp_replicate, "
                                     "dp_shard, tp_size, ep_size; cannot fix sequence_parallel"),
])
def test_bad_worlds_are_refused(world, fixed, message):
    with pytest.raises(ConfigError) as info:
        enumerate_layouts(world, ModelShape(6, 2, 0, 8), fixed)
    assert str(info.value) == message


def test_the_ring_fit_recovers_latency_and_bandwidth_and_scales_with_the_group():
    latency, rate = 20e-6, 3e9
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        steps, volume = ring_factors(kind, 2)
        points = [(n, steps * latency + volume * n / rate) for n in (1024, 1 << 20)]
        found = fit(kind, 2, *points)
        assert math.isclose(found[0], latency, rel_tol=1e-9)
        assert math.isclose(found[1], rate, rel_tol=1e-9)
        costs = Collectives({(kind, 2): found})
        steps4, volume4 = ring_factors(kind, 4)  # a group of 4 reuses the fit of 2
        assert math.isclose(costs.seconds(kind, 4, 5000), steps4 * latency + volume4 * 5000 / rate)
        assert costs.seconds(kind, 1, 5000) == 0.0
    assert Collectives().seconds("all_reduce", 4, 1 << 20) == 0.0  # nothing measured: free


# ------------------------------------------------------------------ the command: refusals
def test_world_refusals_are_one_line_before_anything_is_measured(tmp_path, capsys):
    path = _file(tmp_path, BASE)
    assert _fails(["plan", path, "--world", "0"], capsys) == \
        "pp-core: error: --world: expected the number of processes, an int >= 1, found 0\n"
    assert _fails(["plan", path, "--world", "7"], capsys) == (
        "pp-core: error: --world 7: no layout of 7 processes runs this model: dp 7 does not "
        "divide the global batch of 8 samples; tp_size 7 does not divide the model's 2 "
        "attention heads; pp_size 7 > the model's 6 units (every pipeline rank holds at least "
        "one); use another --world\n")
    assert _fails(["plan", path, "--world", "4", "--set", "distributed.tp_size=3"], capsys) == (
        "pp-core: error: --world 4: the fixed degrees tp_size=3 make 3 processes per layout, "
        "which does not divide 4; drop a fixed degree or use a --world that 3 divides\n")
    auto = _file(tmp_path, apply_overrides(BASE, ["distributed.world_size=8",
                                                  "distributed.layout=auto"]), "auto.yaml")
    assert _fails(["plan", auto, "--world", "4"], capsys) == (
        f"pp-core: error: --world 4 contradicts distributed.world_size: 8 of {auto}; give one "
        f"of them\n")
    assert _fails(["run", auto], capsys) == (
        f"pp-core: error: distributed.layout: auto is chosen by 'pp-core plan {auto} -o "
        f"chosen.yaml' (it ranks the layouts of 8 processes); run the file it writes, or write "
        f"the degrees and drop layout: auto\n")
    wrong = _file(tmp_path, apply_overrides(BASE, ["distributed.world_size=8"]), "wrong.yaml")
    assert "distributed.world_size: expected pp_size * dp_size = 2 * 1 = 2, found 8; drop " \
           "world_size, correct it, or set distributed.layout: auto" in \
           _fails(["validate", wrong], capsys)


def test_a_world_past_what_the_model_can_use_is_refused_at_once(tmp_path, capsys):
    """``--world`` bounded by the model (issue #48, item 4): 2**60 never answered (``divisors``
    looped to n); the message says the largest useful world and why."""
    import time

    path = _file(tmp_path, BASE)
    largest = ("this model runs on at most 96 processes: pp_size up to its 6 units, tp_size up "
               "to its 2 attention heads, dp up to its global batch of 8 samples (6 x 2 x 8); "
               "use a --world of at most 96 (a larger pipeline.pp_batch_size admits more dp "
               "ranks)\n")
    started = time.perf_counter()
    for world in (963761198400, 2 ** 60, 1000000, 97):
        assert _fails(["plan", path, "--world", str(world)], capsys) == \
            f"pp-core: error: --world {world:,}: {largest}"
    assert time.perf_counter() - started < 30  # refused, not enumerated (was: never answered)


def test_the_reasons_for_no_layout_are_summarised():
    """A world the model cannot use names a few reasons and counts the rest (was: one line
    per factorisation, 10 KB at --world 1000000)."""
    shape = ModelShape(num_units=64, num_heads=64, num_experts=0, global_batch_size=3 ** 6)
    admitted, dropped = enumerate_layouts(5120, shape)
    assert not admitted and len(dropped) == 1144
    with pytest.raises(ConfigError) as info:
        WorldPlan(5120, [], dropped, None, 0.0, 0.0).chosen_layout
    assert str(info.value) == (
        "--world 5120: no layout of 5120 processes runs this model (1144 factorisations "
        "dropped): dp 5120 does not divide the global batch of 729 samples; tp_size 5 does not "
        "divide the model's 64 attention heads; pp_size 80 > the model's 64 units (every "
        "pipeline rank holds at least one); and 1141 more for reasons of these kinds; use another "
        "--world")


def test_a_cap_no_layout_fits_exits_non_zero_and_writes_nothing(tmp_path, capsys):
    """``plan --world N --memory-cap`` with nothing under the cap (issue #48, item 6): it
    printed an empty table and exited 0, so ``plan -o chosen.yaml && run chosen.yaml`` ran a
    stale file."""
    path = _file(tmp_path, BASE)
    assert cli.main(["plan", path, "--world", "2", "--no-link", "--memory-cap", "1KiB", "--set",
                     "distributed.tp_size=1"]) == 1
    captured = capsys.readouterr()
    *progress, error = captured.err.splitlines()
    assert captured.out == "" and progress[0] == \
        "plan: profiling at tp 1, microbatch sizes [1, 2, 4]"
    assert all(line.startswith("plan: planning layout ") for line in progress[1:]), progress
    assert error.startswith("pp-core: error: --world 2: no layout of 2 processes runs this "
                            "model: memory: no plan fits memory_cap=1.0 KiB per rank: the "
                            "smallest predicted peak is ") and error.endswith("; use another "
                                                                              "--world"), error


# ------------------------------------------------------------------ the command: real runs
@pytest.fixture(scope="module")
def machine_measured_once():
    """This machine's link and collectives, measured by the first plan of this module that needs
    them and reused by the others: they are the machine's, not the model's (the same call with
    the same arguments - backend, device, the largest dp group). Each plan still profiles its
    model, measures its pipeline factor and times its layouts by runs. On 2 cores the two
    measurements cost a plan ~10 s of spawned helpers importing torch."""
    import functools

    from pp_core.app.plan import plan_world

    with pytest.MonkeyPatch.context() as patch:
        for name in ("measure_local_link", "measure_collectives"):
            patch.setattr(plan_world, name, functools.cache(getattr(plan_world, name)))
        yield


def _check_contract(data, world: int) -> None:
    kept = data["ranking"]["kept"]
    assert data["chosen"] == kept[0]
    steps = [c["predicted_step_s"] for c in kept]
    assert steps == sorted(steps)
    for plan in kept:
        assert PLAN_KEYS <= set(plan)
        product = plan["pp_size"] * plan["dp_replicate"] * plan["dp_shard"] * plan["tp_size"]
        assert product == world
        modes = plan["activation_checkpointing"]
        assert len(modes) == len(plan["fqns_per_stage"])
        assert set(modes) <= {"none", "selective", "full"}


@pytest.mark.cli
@pytest.mark.ranks
def test_world_4_ranks_tp_layouts_and_the_chosen_one_runs(tmp_path, capsys,
                                                          machine_measured_once):
    """The demo-sized GPT at world 4: tp 2 layouts are ranked beside pp and dp ones, tp 4 is
    dropped (2 heads), the JSON keeps its contract; the -o file runs through 'pp-core run' at
    the chosen degrees."""
    path = _file(tmp_path, BASE)
    out = str(tmp_path / "chosen.yaml")
    assert cli.main(["plan", path, "--world", "4", "--json", "-o", out]) == 0
    data = json.loads(capsys.readouterr().out)
    _check_contract(data, 4)
    layouts = {(d["pp_size"], d["dp_replicate"] * d["dp_shard"], d["tp_size"])
               for d in data["layouts"]}
    assert {(4, 1, 1), (2, 2, 1), (2, 1, 2)} <= layouts
    assert any(c["tp_size"] > 1 for c in data["ranking"]["kept"])
    assert {d["dropped"] for d in data["ranking"]["dropped"] if d["tp_size"] == 4} == \
        {"tp_size 4 does not divide the model's 2 attention heads"}
    assert 0.5 <= data["pipeline_factor"] <= 3.0  # measured on 4 processes, clipped there
    # pp 4 and pp 2 x tp 2 ran a few steps: each's measured over predicted step scales the
    # layouts at its tp degree
    timed = {(t["tp_size"], t["ep_size"]): t for t in data["timed_layouts"]}
    assert {key: t["layout"] for key, t in timed.items()} == {(1, 1): "pp 4 x dp 1",
                                                              (2, 1): "pp 2 x dp 1 x tp 2"}
    for t in timed.values():
        assert t["measured_step_s"] > 0
        assert t["factor"] == pytest.approx(min(max(
            t["measured_step_s"] / t["predicted_step_s"], BOUNDS[0]), BOUNDS[1]))
    tp_2 = [lay for lay in data["layouts"] if (lay["pp_size"], lay["tp_size"]) == (2, 2)]
    assert tp_2[0]["predicted_step_s"] == pytest.approx(timed[2, 1]["measured_step_s"])
    engine = data["collectives"]["engine"]  # FSDP2's hooks and DTensor's dispatch, measured
    assert engine["forward_s"] > 0 and engine["backward_s"] > 0
    assert engine["step_s_per_tensor"] > 0
    written = yaml.safe_load(open(out))
    chosen = data["chosen"]
    assert {k: written["distributed"].get(k, 1) for k in DEGREES} == \
        {k: chosen[k] for k in DEGREES}  # a degree of 1, the default, is left out
    # the default schedule (1f1b), when chosen, is left out as well
    assert written["pipeline"].get("pp_schedule", "1f1b") == chosen["schedule"]
    metrics = tmp_path / "metrics.jsonl"
    assert cli.main(["run", out, "--set", f"output.metrics={metrics}"]) == 0
    capsys.readouterr()
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()
            if '"loss"' in line][-1:] == [1]


@pytest.mark.cli
@pytest.mark.ranks
def test_world_4_moe_ranks_expert_parallel_layouts(tmp_path, capsys, machine_measured_once):
    """moe_gpt at world 4: ep 2 layouts (experts sharded over 2 dp ranks, tokens by
    all-to-all, costed from its measured fit) ranked; tp dropped (no plan for the model)."""
    path = _file(tmp_path, MOE)
    assert cli.main(["plan", path, "--world", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    _check_contract(data, 4)
    assert any(c["ep_size"] == 2 and c["pp_size"] == 2 for c in data["ranking"]["kept"])
    assert "all_to_all@2" in data["collectives"]
    timed = {(t["tp_size"], t["ep_size"]): t["layout"] for t in data["timed_layouts"]}
    assert timed == {(1, 1): "pp 4 x dp 1", (1, 2): "pp 2 x dp 2, ep 2",
                     (1, 4): "pp 1 x dp 4, ep 4"}
    assert {d["dropped"] for d in data["ranking"]["dropped"] if d["tp_size"] == 2} == \
        {"tp_size 2: no plugin provides a tensor-parallel plan for the model MoEGPT"}


# ------------------------------------------------------------------ what a degree costs
def test_a_layout_profile_charges_experts_optimizer_shards_and_shared_cores():
    """ep 2: a MoE unit keeps half its experts' bytes and pays the all-to-alls (counts,
    dispatch, combine) in F and again in B; dp_shard 2 halves the optimizer state; 4 processes
    of one thread on this machine's cores share them as shared_processors says."""
    import types

    from pp_core.devices import cpu_cores, shared_processors
    from pp_core.measure.layout_costs import layout_profile
    from pp_core.parallel.dims import ParallelDims
    from pp_core.planning.costs import ModelProfile, UnitCost

    def unit(name):
        return UnitCost((name,), 1e-3, 2e-3, 1e-3, 1e-3, 4096, 8192, 1024)

    profile = ModelProfile(2, (unit("embed"), unit("layers.0")), 1e-5, 1e9)
    costs = Collectives({("all_to_all", 2): (1e-5, 1e8)})
    experts = [(0, 0, 0, 0), (1, 4000, 2, 4)]  # the block: one MoE layer, 4000 expert bytes
    layout = types.SimpleNamespace(threads_per_rank=1, device="cpu")
    dims = ParallelDims(pp=2, dp_shard=2, ep=2)
    found = layout_profile(profile, dims, 4, layout, costs, experts)
    traffic = costs.seconds("all_to_all", 2, 8 * 4) + 2 * costs.seconds("all_to_all", 2, 2048)
    embed, block = found.units
    assert embed == profile.units[0]
    assert block.param_bytes == 8192 - 2000
    assert math.isclose(block.forward_s, 1e-3 + traffic)
    assert math.isclose(block.backward_s, 2e-3 + traffic)
    assert found.optimizer_bytes_per_param_byte == profile.optimizer_bytes_per_param_byte / 2
    assert found.processors == (shared_processors(cpu_cores(), 1, 4, 2) or 0.0)


def test_a_dp_layout_charges_the_engine_per_unit_call_and_per_tensor_step():
    """dp 2: every unit is in an FSDP2 module whose hooks cost the measured time in each F, B
    and I (W runs no hook); the optimizer step pays DTensor's per-tensor dispatch, unless the
    profile was measured at tp > 1 (its parameters were DTensors already). dp 1: nothing."""
    import types

    from pp_core.measure.layout_costs import layout_profile
    from pp_core.parallel.dims import ParallelDims
    from pp_core.planning.collectives import EngineCosts
    from pp_core.planning.costs import ModelProfile, UnitCost

    unit = UnitCost(("layers.0",), 1e-3, 2e-3, 1e-3, 1e-3, 4096, 8192, 1024, trained_tensors=4,
                    recompute=(("full", 1e-3, 3e-3, 2e-3, 100, 0),))
    profile = ModelProfile(2, (unit,), 1e-5, 1e9)
    costs = Collectives(engine=EngineCosts(forward_s=2e-4, backward_s=3e-4,
                                           step_s_per_tensor=5e-5))
    layout = types.SimpleNamespace(threads_per_rank=1, device="cpu")
    found = layout_profile(profile, ParallelDims(pp=1, dp_replicate=2), 2, layout, costs, [])
    (wrapped,) = found.units
    assert (wrapped.forward_s, wrapped.backward_s, wrapped.input_grad_s, wrapped.weight_grad_s) \
        == pytest.approx((1.2e-3, 2.3e-3, 1.3e-3, 1e-3))
    assert wrapped.recompute == (("full", pytest.approx(1.2e-3), pytest.approx(3.3e-3),
                                  pytest.approx(2.3e-3), 100, 0),)
    assert found.optimizer_s_per_tensor == 5e-5
    tp = layout_profile(profile, ParallelDims(pp=1, dp_replicate=2, tp=2), 4, layout, costs, [])
    assert tp.optimizer_s_per_tensor == 0.0 and tp.units[0].forward_s == pytest.approx(1.2e-3)
    alone = layout_profile(profile, ParallelDims(pp=1), 1, layout, costs, [])
    assert alone.units == profile.units and alone.optimizer_s_per_tensor == 0.0


def test_a_scaled_profile_costs_every_compute_time_and_action_more_and_nothing_else():
    from pp_core.planning.costs import ModelProfile, UnitCost

    unit = UnitCost(("layers.0",), 1e-3, 2e-3, 1e-3, 1e-3, 4096, 8192, 1024,
                    recompute=(("full", 1e-3, 3e-3, 2e-3, 100, 7),))
    profile = ModelProfile(2, (unit,), 1e-5, 1e9, action_overhead_s=1e-4,
                           optimizer_s_per_param_byte=1e-9)
    scaled = profile.scaled(1.5)
    (found,) = scaled.units
    assert (found.forward_s, found.backward_s, found.input_grad_s, found.weight_grad_s) == \
        pytest.approx((1.5e-3, 3e-3, 1.5e-3, 1.5e-3))
    assert found.recompute == (("full", pytest.approx(1.5e-3), pytest.approx(4.5e-3),
                                pytest.approx(3e-3), 100, 7),)
    assert scaled.action_overhead_s == pytest.approx(1.5e-4)
    assert (found.activation_bytes, found.param_bytes, scaled.p2p_latency_s,
            scaled.optimizer_s_per_param_byte) == (4096, 8192, 1e-5, 1e-9)
    assert profile.scaled(1.0) is profile


def test_gradient_sync_is_added_once_per_step_for_the_slowest_rank():
    from pp_core.measure.layout_costs import with_gradient_sync
    from pp_core.parallel.dims import ParallelDims
    from pp_core.planning.choose import Candidate, Option, Ranking
    from pp_core.planning.memory import RankMemory

    costs = Collectives({(kind, 2): (1e-5, 1e9) for kind in ("all_reduce", "all_gather",
                                                              "reduce_scatter")})
    small, large = RankMemory(0, 1000, 1000, 0, 0, 0, 0), RankMemory(1, 9000, 9000, 0, 0, 0, 0)
    fast = Candidate(Option("1f1b", 1, 1, 4), predicted_step_s=0.010, memory=[small, large],
                     fqns_per_stage=[["embed", "layers.0"], ["layers.1", "head"]])
    ranking = Ranking([fast], [], None, 0.0, 2, 4)
    with_gradient_sync(ranking, ParallelDims(pp=2, dp_replicate=2, dp_shard=2), costs)
    assert math.isclose(fast.predicted_step_s,  # 4 modules over 2 ranks: 2 FSDP units each
                        0.010 + costs.gradient_sync_s(9000, 9000, 2, 2, pieces=2))
    assert costs.gradient_sync_s(9000, 9000, 2, 2, pieces=2) == pytest.approx(2 * (
        costs.seconds("all_gather", 2, 4500) + costs.seconds("reduce_scatter", 2, 4500)
        + costs.seconds("all_reduce", 2, 2250)))


def test_one_layout_per_tp_and_ep_degree_is_timed_and_scales_its_degrees_plans():
    """The layout run for a (tp, ep) pair is its deepest pipeline. Its measured over
    predicted step multiplies every plan predicted at those degrees, kept and dropped, their
    order unchanged."""
    from pp_core.app.plan.timed_layouts import calibrated, timed_degrees
    from pp_core.parallel.dims import ParallelDims
    from pp_core.planning.choose import Candidate, Option, Ranking

    admitted = [ParallelDims(pp=4), ParallelDims(pp=2, tp=2), ParallelDims(pp=1, dp_shard=2,
                                                                           tp=2),
                ParallelDims(pp=1, dp_replicate=4, ep=2), ParallelDims(pp=2, dp_replicate=2,
                                                                       ep=2)]
    assert timed_degrees(admitted) == {(1, 1): ParallelDims(pp=4),
                                       (2, 1): ParallelDims(pp=2, tp=2),
                                       (1, 2): ParallelDims(pp=2, dp_replicate=2, ep=2)}
    fast = Candidate(Option("1f1b", 1, 2, 4), predicted_step_s=0.010, optimizer_step_s=0.002)
    slow = Candidate(Option("gpipe", 1, 2, 4), predicted_step_s=0.015)
    dropped = Candidate(Option("zbv", 2, 2, 4), predicted_step_s=0.020, dropped="memory")
    ranking = Ranking([fast, slow], [dropped], None, 0.0, 2, 4)
    calibrated(ranking, 1.5)
    assert [c.predicted_step_s for c in ranking.kept + ranking.dropped] == \
        pytest.approx([0.015, 0.0225, 0.030])
    assert fast.optimizer_step_s == pytest.approx(0.003)
