"""Activation checkpointing per stage, measured and run: the profile's costs per mode, a cap that
only a per-stage choice meets (chosen, then run: each stage's blocks checkpointed by its own mode,
training as the unsplit model does on one process: losses, gradients, parameters),
``pp-core plan --json`` keys and ``-o FILE`` run by ``pp-core run``."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from pp_core.app import cli
from pp_core.app.spec import apply_overrides, parse_spec
from pp_core.losses import cross_entropy
from pp_core.measure.profile import profile_model
from pp_core.parallel.activation import checkpoint_mode
from pp_core.parallel.blocks import find_blocks
from pp_core_builtins.models import GPT
from tests.cases.specs import tiny_gpt_spec
from tests.cases.warm import warm_launch

MODEL = {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2, "max_seq_len": 32}
BASE = tiny_gpt_spec(model={"args": MODEL}, data={"args": {"seq_len": 32}},
                     pipeline={"pp_schedule": "auto", "pp_batch_size": 8, "pp_microbatch_size": None},
                     distributed={"device": "cpu"},
                     train={"optimizer": {"name": "AdamW", "lr": 0.01},
                            "activation_checkpointing": "auto"})
DEGREES = ("pp_size", "dp_replicate", "dp_shard", "tp_size", "ep_size")


def test_the_profile_measures_what_each_mode_costs_and_saves_and_leaves_the_model_as_found():
    torch.manual_seed(0)
    model = GPT(**MODEL)
    x = torch.randint(0, 32, (2, 32))
    profile = profile_model(model, x, x, cross_entropy, [2], repeats=1,
                            recompute_modes=("full", "selective"))[2]
    blocks = [u for u in profile.units if u.fqns[0].startswith("layers.")]
    assert len(blocks) == 4
    for unit in blocks:
        full, selective = unit.under("full"), unit.under("selective")
        assert full.activation_bytes < selective.activation_bytes < unit.activation_bytes
        assert full.backward_s > 0 and full.transient_bytes >= unit.transient_bytes
    assert not profile.units[0].recompute and not profile.units[-1].recompute
    assert all(checkpoint_mode(block) is None for _, block in find_blocks(model))


def ran(spec):
    """On every rank: train, recording each local stage's blocks and their AC mode, and after
    the last step its parameters and their gradients (that step's: set afresh each step)."""
    from pp_core.app import rank as train_module

    seen, parts_of = {}, []
    original = train_module.parallelize

    def recording(pipe, meshes, settings):
        done = original(pipe, meshes, settings)
        parts_of.extend(pipe.model_parts)
        for part, stage in zip(pipe.model_parts, pipe.stage_indices):
            seen[stage] = {(checkpoint_mode(b) or ("none",))[0] for _, b in find_blocks(part)}
        return done

    train_module.parallelize = recording
    summary = train_module.train(spec) or {}
    named = {n: p for part in parts_of for n, p in part.named_parameters()}
    return {"blocks": seen, "losses": summary.get("losses"),
            "params": {n: p.detach().clone() for n, p in named.items()},
            "grads": {n: p.grad.clone() for n, p in named.items() if p.grad is not None}}


def one_process(spec):
    """The unsplit model trained on one process over the same batches: per step the loss of
    the whole batch, then its gradients and the AdamW step; the losses, the last step's
    gradients and the parameters after it."""
    from pp_core.app.factories import build_dataset, build_model

    model = build_model(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE["train"]["optimizer"]["lr"])
    losses, batches = [], iter(build_dataset(spec))
    for _ in range(spec.train.steps):
        inputs, target = next(batches)
        model.zero_grad(set_to_none=True)
        loss = cross_entropy(model(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    named = dict(model.named_parameters())
    return (losses, {n: p.detach() for n, p in named.items()},
            {n: p.grad for n, p in named.items()})


def block_stage_modes(candidate) -> list[str]:
    """The modes of the stages that hold blocks (a stage of the embedding alone has none)."""
    return [mode for mode, fqns in zip(candidate.activation_checkpointing,
                                       candidate.fqns_per_stage)
            if any(f.startswith("layers.") for f in fqns)]


@pytest.fixture(scope="module")
def planned():
    """The spec's plan (profiled once) and a cap no AC-free plan fits but a per-stage one does."""
    from pp_core.app.launch.decide import plan_spec
    from pp_core.planning.choose import choose_plan

    spec = parse_spec(apply_overrides(BASE, ()), "ac.yaml")
    plan = plan_spec(spec, measure_link=False)
    free = choose_plan(plan.profiles, 2, 8, activation_checkpointing="none")
    lowest = min(c.peak_bytes for c in free.kept)
    for fraction in (0.98, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7):
        cap = int(lowest * fraction)
        ranking = choose_plan(plan.profiles, 2, 8, memory_cap=cap,
                              activation_checkpointing="auto")
        if ranking.kept and len(set(block_stage_modes(ranking.chosen))) > 1:
            return spec, plan, ranking, cap
    pytest.fail(f"no cap below {lowest} gave a mixed per-stage plan")


@pytest.mark.ranks
def test_a_cap_no_ac_free_plan_fits_is_met_by_recomputing_on_some_stages_and_run_so(planned):
    from pp_core.app.launch.decide import resolved_spec
    from pp_core.measure.plan_auto import AutoPlan, concrete_config
    from pp_core.planning.choose import choose_plan

    spec, plan, ranking, cap = planned
    assert not choose_plan(plan.profiles, 2, 8, memory_cap=cap).kept  # AC-free: nothing fits
    chosen = ranking.chosen
    modes = chosen.activation_checkpointing
    assert "none" in block_stage_modes(chosen) and chosen.peak_bytes <= cap
    assert set(block_stage_modes(chosen)) - {"none"}
    run_spec = resolved_spec(spec, AutoPlan(concrete_config(spec.pipeline, chosen), ranking))
    assert run_spec.train.activation_checkpointing["mode"] == modes
    assert run_spec.prediction["activation_checkpointing"] == modes
    results = warm_launch(run_spec, entrypoint=ran)
    seen = {stage: got for r in results.values() for stage, got in r["blocks"].items()}
    for stage, mode in enumerate(modes):
        if stage in seen and seen[stage]:  # a stage of blocks: all by its own mode
            assert seen[stage] == {mode}, (stage, seen)
    assert any(m == "none" for s, m in enumerate(modes) if seen.get(s))
    assert any(m != "none" for s, m in enumerate(modes) if seen.get(s))
    # and it trains as the unsplit model on one process does (fp32)
    losses, params, grads = one_process(run_spec)
    assert results[0]["losses"] == pytest.approx(losses, rel=1e-5)
    got = {"params": {}, "grads": {}}
    for r in results.values():
        for kind in got:
            got[kind].update(r[kind])
    assert got["params"].keys() == params.keys() and got["grads"].keys() == grads.keys()
    for name, want in grads.items():
        torch.testing.assert_close(got["grads"][name], want, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
    # AdamW divides each gradient by its running magnitude: where a gradient is near zero, a
    # difference in the last bits of the summation order moves that weight by ~1e-6 of lr 0.01
    for name, want in params.items():
        torch.testing.assert_close(got["params"][name], want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.ranks
def test_plan_json_keys_and_the_written_yaml_runs_as_it_stands(tmp_path, capsys):
    path, out = tmp_path / "auto.yaml", tmp_path / "chosen.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert cli.main(["plan", str(path), "--json", "--no-link", "-o", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    for plan in [data["chosen"], *data["ranking"]["kept"]]:
        assert len(plan["activation_checkpointing"]) == len(plan["fqns_per_stage"])
        assert set(plan["activation_checkpointing"]) <= {"none", "selective", "full"}
        assert {k: plan[k] for k in DEGREES} == {"pp_size": 2, "dp_replicate": 1,
                                                 "dp_shard": 1, "tp_size": 1, "ep_size": 1}
    written = yaml.safe_load(out.read_text())
    assert written["pipeline"]["pp_schedule"] == data["chosen"]["schedule"]
    assert written["train"]["activation_checkpointing"]["mode"] == \
        data["chosen"]["activation_checkpointing"]
    assert written["pipeline"]["pp_schedule"] != "auto" and "prediction" not in written
    assert cli.main(["run", str(out), "--set", "train.steps=1"]) == 0
    assert cli.main(["plan", str(path), "--no-link", "-o", str(path)]) == 1
    assert "is the pipeline file, which this command reads" in capsys.readouterr().err


def test_auto_ac_needs_the_planner_and_a_stage_list_must_match_the_stages(tmp_path, capsys):
    fixed = {**BASE, "pipeline": {**BASE["pipeline"], "pp_schedule": "1f1b"}}
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(fixed))
    assert cli.main(["validate", str(path)]) == 1
    assert "train.activation_checkpointing.mode: auto is chosen per stage by the planner" in \
        capsys.readouterr().err
    listed = {**fixed, "train": {**fixed["train"],
                                 "activation_checkpointing": ["full", "none", "none"]}}
    path.write_text(yaml.safe_dump(listed))
    assert cli.main(["validate", str(path)]) == 1
    assert "lists 3 modes, one per stage, but the pipeline has 2 stages" in \
        capsys.readouterr().err
