"""Fixtures the application tests share across modules."""

from __future__ import annotations

import json
import os

import pytest

from tests.cases.specs import ROOT, pp_core, tiny_gpt_spec, write_spec


@pytest.fixture(scope="session")
def uninterrupted_losses(uninterrupted_run) -> dict[int, float]:
    """The last logged loss of each of 8 steps of the tiny GPT at pp 2 x dp 2 (a checkpoint
    every 4) that nothing interrupted: what a restarted run (test_restarts) and a shrunk one
    (test_shrink) must reproduce. One run for both modules: a 4-rank launch costs ~10 s."""
    lines = [json.loads(line) for line in (uninterrupted_run / "m.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory):
    """The folder of that run: its metrics (``m.jsonl``) and checkpoints (``ckpt``)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    spec = tiny_gpt_spec(distributed={"dp_size": 2, "device": "cpu"},
                         train={"steps": 8, "log_every": 1},
                         checkpoint={"dir": str(tmp / "ckpt"), "every": 4},
                         output={"metrics": str(tmp / "m.jsonl"), "progress": "plain"})
    env = {key: value for key, value in os.environ.items() if key != "PP_CORE_TIMEOUT"}
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp))
    result = pp_core("run", str(write_spec(tmp / "clean.yaml", spec)), env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp
