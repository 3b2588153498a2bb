"""The shared test helpers hold what the suite relies on them for: the one-process comparison
sees every difference it is asked about, the tiny spec changes only what a test names, and the
fast tier refuses a test that starts a process without saying so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.cases.compare import ABSOLUTE, RELATIVE, UNIT, grad_difference, reference_grads
from tests.cases.specs import tiny_gpt_spec


def _with_grads(model: nn.Module, value: float) -> nn.Module:
    for param in model.parameters():
        param.grad = torch.full_like(param, value)
    return model


def test_grad_difference_scales_as_asked_and_names_every_parameter():
    torch.manual_seed(0)
    reference = _with_grads(nn.Linear(2, 2), 2.0)
    part = _with_grads(nn.Linear(2, 2), 2.5)
    want = reference_grads(reference)
    assert grad_difference([part], want, scale=ABSOLUTE).worst == pytest.approx(0.5)
    assert grad_difference([part], want, scale=RELATIVE).worst == pytest.approx(0.25)
    assert grad_difference([part], want, scale=UNIT).worst == pytest.approx(0.5 / 3)
    assert grad_difference([part], want, factor=1.25).worst == 0.0
    assert grad_difference([part], want).names == ["weight", "bias"]


def test_a_missing_gradient_is_reported_unless_the_reference_has_none_either():
    reference = _with_grads(nn.Linear(2, 2), 1.0)
    part = nn.Linear(2, 2)
    assert grad_difference([part], reference_grads(reference)).missing == ["weight", "bias"]
    assert grad_difference([part], reference_grads(reference), none_is_zero=True).missing == [
        "weight", "bias"]
    zero = _with_grads(nn.Linear(2, 2), 0.0)
    assert grad_difference([part], reference_grads(zero), none_is_zero=True).missing == []
    assert grad_difference([part], reference_grads(zero)).missing == ["weight", "bias"]


def test_an_expert_shard_is_compared_with_its_rows_and_tied_copies_under_each_name():
    experts = nn.Linear(3, 2, bias=False)  # rank 1 of 2 holds rows 2 and 3 of the 4 experts
    reference = {"weight": torch.arange(12.0).reshape(4, 3)}
    experts.weight.pp_expert_parallel = True
    experts.weight.grad = reference["weight"][2:].clone()
    assert grad_difference([experts], reference, expert_rank=1, expert_ranks=2).worst == 0.0
    assert grad_difference([experts], reference, expert_rank=0, expert_ranks=2).worst == 6.0

    tied = nn.Module()
    tied.embed = nn.Embedding(4, 2)
    tied.head = nn.Linear(2, 4, bias=False)
    tied.head.weight = tied.embed.weight
    tied.embed.weight.grad = torch.ones(4, 2)
    want = {"embed.weight": torch.ones(4, 2), "head.weight": torch.zeros(4, 2)}
    assert grad_difference([tied], want).names == ["embed.weight"]
    copies = grad_difference([tied], want, tied_copies=True)
    assert copies.names == ["embed.weight", "head.weight"] and copies.worst == 1.0


def test_tiny_gpt_spec_merges_at_every_depth_and_none_removes():
    base = tiny_gpt_spec()
    spec = tiny_gpt_spec(model={"args": {"num_layers": 2, "vocab_size": None}},
                         train={"steps": 5}, output=None, checkpoint={"every": 2})
    assert spec["model"] == {"name": "gpt", "args": {"dim": 16, "num_layers": 2, "num_heads": 2,
                                                     "max_seq_len": 8}}
    assert spec["train"] == {"steps": 5} and "output" not in spec
    assert spec["checkpoint"] == {"every": 2} and spec["data"] == base["data"]
    spec["data"]["args"]["seq_len"] = 99  # a fresh copy each time: no test sees another's change
    assert tiny_gpt_spec()["data"]["args"]["seq_len"] == 8


@pytest.mark.cli
def test_the_fast_tier_refuses_an_unmarked_test_that_starts_a_process(tmp_path):
    test = tmp_path / "test_starts.py"
    test.write_text("import subprocess, sys\n"
                    "def test_unmarked():\n"
                    "    subprocess.run([sys.executable, '-c', 'pass'])\n")
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F401,F403\n")
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    fast = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path,
                          env={**env, "PP_CORE_FAST_TIER": "1"})
    assert fast.returncode == 1 and "marked neither ranks nor cli" in fast.stdout, fast.stdout
    full = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert full.returncode == 0, full.stdout
