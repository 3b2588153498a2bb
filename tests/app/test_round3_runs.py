"""Real runs for issue #34's fixes: packed rows with sequence parallelism train on the demo GPT
(the position embedding's plan assumed unbatched positions), and a NaN stop prints its message
and no traceback after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

ARGS = {"vocab_size": 256, "dim": 32, "num_layers": 2, "num_heads": 2, "max_seq_len": 16}


def _run(tmp_path, values) -> subprocess.CompletedProcess:
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(values))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "pp_core", "run", "pipe.yaml"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.cli
@pytest.mark.ranks
def test_packed_rows_with_sequence_parallel_train_the_demo_gpt(tmp_path):
    (tmp_path / "corpus.jsonl").write_text("\n".join(
        json.dumps({"text": f"document {i}: a few words of text to pack."}) for i in range(64)))
    result = _run(tmp_path, {
        "model": {"name": "gpt", "args": ARGS},
        "data": {"name": "tokenized_text", "args": {"files": ["corpus.jsonl"], "tokenizer": "bytes",
                                                    "seq_len": 16, "pack": True,
                                                    "cache_dir": "cache"}},
        "pipeline": {"pp_schedule": "gpipe", "pp_batch_size": 4, "pp_microbatch_size": 2,
                     "loss_fn": "cross_entropy"},
        "distributed": {"pp_size": 1, "tp_size": 2, "sequence_parallel": True, "device": "cpu"},
        "train": {"steps": 2},
        "output": {"progress": "off", "summary": False, "metrics": "metrics.jsonl"}})
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses), losses


NAN_LOSS = """
import torch.nn.functional as F

def nan_loss(output, target):
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten()) * float("nan")
"""


@pytest.mark.cli
@pytest.mark.ranks
def test_a_nan_stop_prints_its_message_and_no_traceback(tmp_path):
    (tmp_path / "nanloss.py").write_text(NAN_LOSS)
    result = _run(tmp_path, {
        "model": {"name": "gpt", "args": {**ARGS, "vocab_size": 32, "max_seq_len": 8}},
        "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 32}},
        "pipeline": {"pp_schedule": "1f1b", "pp_batch_size": 2, "loss_fn": "nanloss:nan_loss"},
        "distributed": {"pp_size": 2, "device": "cpu"},
        "train": {"steps": 2},
        "output": {"progress": "off", "summary": False}})
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert lines[-1].startswith("pp-core: error: rank ") and "NonFiniteStep: step 1: the loss " \
        "nan and gradient norm nan is not finite; training stopped before the update" in lines[-1]
    assert "Traceback" not in result.stderr, result.stderr
