"""``pp-core run`` with ``moe_gpt``: expert parallelism changes where experts live, never the
numbers (ep 1 and ep 2 give the same losses for 8 steps), and ``examples/moe.yaml`` validates
and runs; the metrics carry the aux loss. ``pp-core validate`` refuses an ep_size that does not
divide dp or num_experts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cases.specs import TINY, pp_core, write_spec  # noqa: F401 (TINY: the base spec)

MOE = {**TINY,
       "model": {"name": "moe_gpt", "args": {"vocab_size": 32, "dim": 16, "num_layers": 4,
                                            "num_heads": 2, "max_seq_len": 8, "num_experts": 4,
                                            "top_k": 2, "moe_hidden": 16}},
       "distributed": {"pp_size": 2, "dp_replicate": 2, "device": "cpu"}}
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
# examples/moe.yaml made tiny: 8 steps, 4 experts, clipping on, a heavy aux loss
TINY_EXAMPLE = ["model.args.vocab_size=32", "model.args.dim=16", "model.args.max_seq_len=8",
                "model.args.num_experts=4", "model.args.moe_hidden=16",
                "model.args.aux_loss_coef=0.1", "data.args.vocab_size=32", "data.args.seq_len=8",
                "pipeline.pp_batch_size=4", "pipeline.pp_microbatch_size=2", "train.steps=8",
                "train.log_every=1", "train.grad_clip=0.5", "output.progress=off",
                "output.summary=false", "distributed.device=cpu"]


def _example_metrics(tmp_path, ep: int, here=False) -> list[dict]:
    """The example's metrics at ``ep_size`` from ``pp-core run``: the command end to end, or
    ``here``: through :func:`pp_core.app.cli.main` in this process (its ranks forked warm)."""
    metrics = tmp_path / f"ep{ep}.jsonl"
    sets = [*TINY_EXAMPLE, f"distributed.ep_size={ep}", f"output.metrics={metrics}"]
    argv = ["run", "examples/moe.yaml", *(a for s in sets for a in ("--set", s))]
    if here:
        from pp_core.app import cli

        argv[1] = str(ROOT / argv[1])
        assert cli.main(argv) == 0
    else:
        result = pp_core(*argv, env=ENV, timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.cli
@pytest.mark.ranks
def test_example_runs_and_ep1_and_ep2_give_the_same_losses(tmp_path):
    """The ep 2 run is the command end to end; the ep 1 reference runs in this process."""
    one, two = _example_metrics(tmp_path, 1, here=True), _example_metrics(tmp_path, 2)
    assert len(one) == len(two) == 8
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"])), (a, b)
        assert abs(a["aux_loss"] - b["aux_loss"]) <= 1e-5, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (a, b)
    assert one[-1]["loss"] < one[0]["loss"] and one[0]["aux_loss"] > 0


def test_validate_checks_ep_against_dp_and_num_experts():
    """In process (what ``pp-core validate`` runs): the example passes; an ep_size that does
    not divide dp (spec) or num_experts (the model's plan) is refused naming the key."""
    import yaml

    from pp_core.app.check import preflight
    from pp_core.app.spec import SpecError, parse_spec

    example = yaml.safe_load((ROOT / "examples" / "moe.yaml").read_text())
    preflight(parse_spec(example), run_checks=False)
    for ep, dp, expected in ((3, 2, "distributed.ep_size: expected a divisor of the "
                                    "data-parallel size"),
                             (4, 4, "does not divide num_experts=6 of layers.0.moe")):
        model = {**MOE["model"], "args": {**MOE["model"]["args"], "num_experts": 6}}
        values = {**MOE, "model": model,
                  "distributed": {"pp_size": 2, "dp_replicate": dp, "ep_size": ep}}
        with pytest.raises(SpecError) as error:
            preflight(parse_spec(values), run_checks=False)
        assert expected in str(error.value), str(error.value)
    saving = {**MOE, "distributed": {"pp_size": 2, "dp_replicate": 2, "ep_size": 2},
              "checkpoint": {"dir": "runs/moe"}}
    parse_spec(saving)  # expert-parallel checkpoints save and resume (test_moe_checkpoint.py)
    plain = {**MOE, "model": {"name": "gpt", "args": {"dim": 16, "num_layers": 4}},
             "distributed": {"pp_size": 2, "dp_replicate": 2, "ep_size": 2}}
    with pytest.raises(SpecError, match="needs a model with experts"):
        preflight(parse_spec(plain), run_checks=False)
