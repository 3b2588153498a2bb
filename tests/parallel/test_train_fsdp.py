"""``distributed.dp_shard`` / ``dp_replicate`` in a pipeline file: the YAML runner shards each
stage with FSDP2 over the mesh ``(pp, dp_replicate, dp_shard)`` and trains exactly as the same
pipeline without data parallelism on the same global batch; ``dp_size`` keeps its meaning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pp_core.app.spec import SpecError, parse_spec
from pp_core.app.rank import train
from tests.cases.warm import warm_launch

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2, "max_seq_len": 8}
GLOBAL_BATCH, STEPS = 8, 6
BASE = {"model": {"name": "gpt"}, "data": {"name": "synthetic"}}


def spec_values(schedule: str, dp_shard: int) -> dict:
    return {
        "model": {"name": "gpt", "args": MODEL},
        "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 32, "seed": 3}},
        "pipeline": {"pp_schedule": schedule, "pp_batch_size": GLOBAL_BATCH // dp_shard,
                     "pp_microbatch_size": 2, "loss_fn": "cross_entropy",
                     "scale_grads_in_schedule": schedule == "zero_bubble"},
        "distributed": {"pp_size": 2, "dp_shard": dp_shard, "device": "cpu"},
        # grad_clip below the norm: every step clips, so the DTensor norm must be the whole one
        "train": {"steps": STEPS, "seed": 7, "grad_clip": 0.3,
                  "optimizer": {"name": "AdamW", "lr": 0.01}},
        "output": {"progress": "off", "summary": False},
    }


@pytest.mark.ranks
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pp2_fsdp2_trains_like_pp2_alone_on_the_global_batch(schedule):
    alone = warm_launch(parse_spec(spec_values(schedule, 1), "pp2.yaml"), train)[0]
    sharded = warm_launch(parse_spec(spec_values(schedule, 2), "pp2fsdp2.yaml"), train)[0]
    assert sharded["dp_units"] == 3 and alone["dp_units"] == 0
    assert len(sharded["losses"]) == STEPS and sharded["losses"][-1] < sharded["losses"][0]
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(alone["losses"]),
                               rtol=0, atol=1e-5)


def test_dp_keys_fold_into_dp_size():
    dist = lambda **d: parse_spec({**BASE, "distributed": d}).distributed  # noqa: E731
    assert dist(pp_size=2, dp_shard=2).dp_size == 2
    assert dist(pp_size=2, dp_size=2).dp_replicate == 2  # the older key: replicas
    folded = dist(dp_replicate=2, dp_shard=3)
    assert folded.dp_size == 6 and dist(**vars(folded)).dp_size == 6  # reading twice is stable
    assert parse_spec({**BASE, "distributed": {"dp_shard": 2}}).world_size == 4
    with pytest.raises(SpecError, match=r"distributed.dp_size: expected dp_replicate \* dp_shard"):
        dist(dp_size=4, dp_replicate=3)
    with pytest.raises(SpecError, match=r"distributed.mixed_precision: expected a mapping"):
        dist(dp_shard=2, mixed_precision={"param_dtype": "int8"})
    with pytest.raises(SpecError, match=r"distributed.mixed_precision: applies to the data-par"):
        dist(mixed_precision={"param_dtype": "bfloat16"})
    assert dist(dp_shard=2, mixed_precision={"param_dtype": "bfloat16"}).mixed_precision == \
        {"param_dtype": "bfloat16"}


@pytest.mark.cli
@pytest.mark.ranks
def test_example_validates_and_runs_on_four_ranks(tmp_path):
    """``pp-core run`` validates the file before it starts the ranks."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    command = [sys.executable, "-m", "pp_core", "run", "examples/pp_fsdp.yaml", "--set",
               "train.steps=2", "--set", f"output.metrics={tmp_path / 'm.jsonl'}",
               "--set", "distributed.device=cpu", "--set", "output.progress=off"]
    ran = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "pp 2 x dp 2" in ran.stdout, ran.stdout
    assert (tmp_path / "m.jsonl").read_text().count('"loss"') == 2
