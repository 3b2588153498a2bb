"""``pp_schedule: auto``: planned once, the same concrete plan on every rank (YAML launcher and
``plan_auto`` over a group); refused where it cannot be honoured; ``pp-core plan``."""

from __future__ import annotations

import json

import pytest
import torch

from pp_core import PipelineConfig, build_pipeline
from pp_core.app import cli
from pp_core.errors import ConfigError
from pp_core.app.spec import apply_overrides, parse_spec
from pp_core_builtins.models import GPT
from tests.cases.specs import tiny_gpt_spec
from tests.cases.warm import warm_launch

MODEL = {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2, "max_seq_len": 8}
BASE = tiny_gpt_spec(model={"args": MODEL},
                     pipeline={"pp_schedule": "auto", "pp_microbatch_size": None},
                     distributed={"device": "cpu"},
                     train={"steps": 3, "optimizer": {"name": "AdamW", "lr": 0.01}})


def ran(spec):
    """On every rank: train, and report the pipeline section this rank was given."""
    from pp_core.app.rank import train

    summary = train(spec)
    return {"pipeline": spec.pipeline.to_dict(), "summary": summary}


@pytest.mark.ranks
def test_yaml_auto_is_planned_once_and_every_rank_runs_the_same_concrete_plan(tmp_path):
    spec = parse_spec(apply_overrides(BASE, ()), "auto.yaml")
    results = warm_launch(spec, entrypoint=ran, memory_cap=2 ** 30)
    assert sorted(results) == [0, 1]
    first, second = results[0]["pipeline"], results[1]["pipeline"]
    assert first == second
    assert first["pp_schedule"] != "auto" and first["module_fqns_per_model_part"]
    fqns = [f for stage in first["module_fqns_per_model_part"] for f in stage]
    assert fqns[0] == "tok_embeddings" and fqns[-1] == "output"
    plan = results[0]["summary"]["plan"]
    assert plan["schedule"] == first["pp_schedule"]
    assert plan["microbatch_size"] == first["pp_microbatch_size"]
    assert plan["predicted_step_s"] > 0 and plan["measured_step_s"] > 0
    assert len(results[0]["summary"]["losses"]) == 3


def plan_on_ranks(restrict: bool):
    """Every rank plans with the group; rank 1 passes other arguments, which must not matter."""
    import torch.distributed as dist

    from pp_core import plan_auto

    torch.manual_seed(0)
    model = GPT(**MODEL)
    x = torch.randint(0, 32, (4, 8))
    y = torch.randint(0, 32, (4, 8))
    config = PipelineConfig(pp_schedule="auto", pp_batch_size=4, loss_fn="cross_entropy")
    schedules = None
    if restrict and dist.get_rank() == 1:
        from pp_core.plugin_manager import default_plugins
        from pp_core.schedule.build import resolve_schedule_def

        schedules = {"gpipe": resolve_schedule_def("gpipe", default_plugins())[1]}
    plan = plan_auto(model, config, x, y, 2, group=dist.group.WORLD, schedules=schedules)
    pipe = build_pipeline(model, plan.config)
    loss = pipe.step(x, target=y)
    return {"config": plan.config.to_dict(), "chosen": plan.chosen.to_dict(),
            "link": plan.link, "loss": None if loss is None else float(loss)}


@pytest.mark.ranks
def test_plan_auto_over_a_group_gives_every_rank_rank_0s_plan(pools):
    results = pools(2).run(plan_on_ranks, True)
    assert results[0]["config"] == results[1]["config"]
    assert results[0]["chosen"] == results[1]["chosen"]
    assert results[0]["link"] == results[1]["link"] and results[0]["link"].latency_s > 0
    assert results[1]["loss"] is not None and results[1]["loss"] > 0


def test_build_pipeline_refuses_auto_and_names_the_planner():
    config = PipelineConfig(pp_schedule="auto", pp_batch_size=2, loss_fn="cross_entropy")
    with pytest.raises(ConfigError, match=r"pp_core.plan_auto\(model, config, "
                                          r"inputs, target, pp_size\)"):
        build_pipeline(GPT(**MODEL), config)


@pytest.mark.parametrize("key, value", [("module_fqns_per_model_part", [["a"], ["b"]]),
                                        ("layers_per_stage", 2),
                                        ("pp_schedule_csv", "order.csv")])
def test_auto_with_a_fixed_split_or_schedule_is_refused(key, value):
    with pytest.raises(ConfigError, match=rf"pp_schedule='auto' chooses .* {key} is set too; "
                                          rf"unset {key}"):
        PipelineConfig(pp_schedule="auto", **{key: value})


def test_plan_command_prints_the_ranking_as_json(tmp_path, capsys):
    import yaml

    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert cli.main(["plan", str(path), "--json", "--no-link", "--memory-cap", "1GiB"]) == 0
    data = json.loads(capsys.readouterr().out)
    chosen = data["chosen"]
    assert chosen["peak_bytes"] <= 2 ** 30 and data["ranking"]["memory_cap"] == 2 ** 30
    assert chosen == data["ranking"]["kept"][0]
    assert {c["schedule"] for c in data["ranking"]["kept"]} >= {"1f1b", "gpipe"}


def test_plan_ignores_the_schedule_the_file_names(tmp_path, capsys):
    """A file naming v_schedule (8 stages at pp 4: more than the 6 units) still plans at pp 4."""
    import yaml

    path = tmp_path / "named.yaml"
    named = {**BASE, "pipeline": {**BASE["pipeline"], "pp_schedule": "v_schedule",
                                  "pp_microbatch_size": 1}}
    path.write_text(yaml.safe_dump(named))
    assert cli.main(["plan", str(path), "--json", "--no-link", "--set",
                     "distributed.pp_size=4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranking"]["pp_size"] == 4 and data["chosen"]["schedule"] != "v_schedule"


def test_plan_command_table_and_a_bad_cap(tmp_path, capsys):
    import yaml

    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert cli.main(["plan", str(path), "--no-link", "--memory-cap", "1KiB"]) == 1
    assert "no plan fits memory_cap=1.0 KiB per rank" in capsys.readouterr().err
    assert cli.main(["plan", str(path), "--memory-cap", "8 gigs"]) == 1
    assert "--memory-cap='8 gigs' is not a size" in capsys.readouterr().err


def test_validate_accepts_auto_and_says_when_it_is_decided(tmp_path, capsys):
    import yaml

    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert cli.main(["validate", str(path)]) == 0
    assert "auto: the schedule, microbatch size and split are chosen when the run starts" in \
        capsys.readouterr().out


def test_run_memory_cap_needs_auto(tmp_path, capsys):
    import yaml

    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(apply_overrides(BASE, ["pipeline.pp_schedule=1f1b"])))
    assert cli.main(["run", str(path), "--memory-cap", "1GiB"]) == 1
    assert "--memory-cap=1GiB only steers pipeline.pp_schedule: auto, and the file names " \
           "'1f1b'" in capsys.readouterr().err


def test_cpu_ranks_sharing_the_cores_are_planned_as_sharing_them():
    """4 pipeline ranks: on a machine with fewer cores than that ("auto" reads this machine),
    the profiles record how many ranks' worth of processors the ranks share, and the ranking
    predicts with it; an explicit count is taken as given; a bad one is refused."""
    from pp_core import plan_auto
    from pp_core.devices import cpu_cores, shared_processors

    torch.manual_seed(0)
    model = GPT(**MODEL)
    x = torch.randint(0, 32, (8, 8))
    config = PipelineConfig(pp_schedule="auto", pp_batch_size=8, loss_fn="cross_entropy")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        auto = plan_auto(model, config, x, x, 4, repeats=1, microbatch_sizes=[2])
        given = plan_auto(model, config, x, x, 4, repeats=1, microbatch_sizes=[2],
                          processors=1.5)
        with pytest.raises(ConfigError, match="processors=0 must be a number > 0"):
            plan_auto(model, config, x, x, 4, repeats=1, microbatch_sizes=[2], processors=0)
    finally:
        torch.set_num_threads(threads)
    assert auto.processors == shared_processors(cpu_cores(), 1, 4, 4)
    assert given.processors == 1.5 and given.to_dict()["processors"] == 1.5
    work = sum(u.forward_s + min(u.backward_s, u.input_grad_s + u.weight_grad_s)
               for u in given.profiles[2].units) * 4
    assert given.predicted_step_s >= work / 1.5 * 0.999


def _whole_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.mark.ranks
def test_plan_at_tp_2_profiles_a_sharded_stage(tmp_path, capsys):
    """``pp-core plan`` at tp_size 2 profiles each unit sharded over two processes: the
    parameters the ranking charges a rank are its shard, about half the whole model's (norms
    stay whole); the text names the tp degree; ``pp_schedule: auto`` at tp 2 validates."""
    import yaml

    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(apply_overrides(BASE, ["distributed.tp_size=2"])))
    assert cli.main(["plan", str(path), "--json", "--no-link"]) == 0
    data = json.loads(capsys.readouterr().out)
    whole = _whole_bytes(GPT(**MODEL))
    held = {sum(rank["params"] for rank in candidate["memory_per_rank"])
            for candidate in data["ranking"]["kept"]
            if candidate["stages_per_rank"] == 1}  # each unit on one rank: the sum is all
    assert len(held) == 1 and 0.5 * whole < held.pop() < 0.55 * whole, (held, whole)
    assert cli.main(["validate", str(path)]) == 0
    capsys.readouterr()


@pytest.mark.ranks
def test_sharded_profile_holds_each_units_shard():
    """Per unit, at tp 2: each Linear and Embedding (all sharded by the GPT plan) holds half its
    bytes, the norms all of theirs; the times include the stage's collectives."""
    from torch import nn

    from pp_core.app.machine import MachineShare
    from pp_core.app.launch.measured import plan_sharded

    spec = parse_spec(apply_overrides(BASE, ["distributed.tp_size=2"]), "tp.yaml")
    plan = plan_sharded(spec, MachineShare.of(spec), microbatch_sizes=[1], repeats=1)
    model = GPT(**MODEL)
    units = plan.profiles[1].units
    assert [u.fqns for u in units][-1] == ("norm", "output")
    for unit in units:
        modules = [m for fqn in unit.fqns for m in model.get_submodule(fqn).modules()]
        sharded = sum(_whole_bytes(m) for m in modules if isinstance(m, (nn.Linear, nn.Embedding)))
        norms = sum(_whole_bytes(m) for m in modules if isinstance(m, nn.LayerNorm))
        assert sharded and unit.param_bytes == sharded // 2 + norms, unit.fqns
        assert unit.forward_s > 0 and unit.backward_s > 0
