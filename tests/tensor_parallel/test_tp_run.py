"""Tensor parallelism through ``pp-core run`` (issue 22): ``examples/pp_tp.yaml`` (pp2 x tp2,
sequence parallel) trains and checkpoints; the checkpoint resumes at pp2 x tp1 (another tp size,
no sequence parallelism) and the next steps' losses are those of pp2 x tp2 carrying on (1e-5
relative): the same training, whatever the tp layout. Real processes, real files;
``benchmarks/check_pp_tp_run.py`` compares 20 whole steps of both layouts by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pp_tp.yaml"
SAVE_AT, STEPS = 2, 4


def run(tmp_path: Path, name: str, *overrides: str, here=False) -> dict[int, float]:
    """``pp-core run`` of the example: the command end to end, or ``here``: through
    :func:`pp_core.app.cli.main` in this process (its ranks forked warm)."""
    metrics = tmp_path / f"{name}.jsonl"
    command = [sys.executable, "-m", "pp_core", "run", str(EXAMPLE), "--set",
               f"train.steps={STEPS}", "--set", "train.log_every=1", "--set",
               f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "output.progress=off",
               "--set", "output.summary=false", "--set", f"output.metrics={metrics}",
               *[arg for item in overrides for arg in ("--set", item)]]
    if here:
        from pp_core.app import cli

        # cpu, as the command's hidden CUDA devices
        assert cli.main([*command[3:], "--set", "distributed.device=cpu"]) == 0
    else:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # 4 cpu ranks on a GPU machine too
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    return {row["step"]: row["loss"] for row in map(json.loads, metrics.read_text().splitlines())
            if "loss" in row}


@pytest.mark.cli
@pytest.mark.ranks
def test_pp_tp_run_resumes_at_another_tp_size_with_the_same_losses(tmp_path):
    tp2 = run(tmp_path, "tp2", f"checkpoint.every={SAVE_AT}")
    assert sorted(tp2) == list(range(1, STEPS + 1))
    saved = tmp_path / "ckpt" / f"step_{SAVE_AT:08d}"
    tp1 = run(tmp_path, "tp1", f"checkpoint.resume={saved}", "distributed.tp_size=1",
              "distributed.sequence_parallel=false", here=True)
    assert sorted(tp1) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in tp1.items():
        assert loss == pytest.approx(tp2[step], rel=1e-5), (step, loss, tp2[step])
