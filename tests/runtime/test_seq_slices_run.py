"""``pp-core run`` on a packed tokenized corpus with ``pipeline.pp_seq_chunks: 4`` equals K = 1.

Two runs of ``examples/tokenized.yaml`` (pp 2, 1F1B, the byte tokenizer, rows of 32 tokens whose
documents cross the slices): every logged step's loss is K = 1's (fp32, 1e-5); every metrics
record carries ``peak_saved_bytes`` and the summary prints it per rank.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.cases.specs import pp_core


def _run(tmp_path, chunks: int):
    metrics = tmp_path / f"k{chunks}" / "metrics.jsonl"
    args = [f"data.args.cache_dir={tmp_path / 'cache'}", "model.args.dim=32",
            "data.args.seq_len=32", "model.args.max_seq_len=32", "train.steps=3",
            "train.log_every=1", "train.eval_every=null", "train.warmup_steps=0",
            "pipeline.pp_batch_size=4", f"pipeline.pp_seq_chunks={chunks}",
            "output.progress=plain", f"output.metrics={metrics}"]
    result = pp_core("run", "examples/tokenized.yaml", *[x for a in args for x in ("--set", a)],
                     env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in records if "loss" in r], result.stdout


@pytest.mark.cli
@pytest.mark.ranks
def test_run_with_slices_equals_the_unsliced_run(tmp_path):
    plain, _ = _run(tmp_path, 1)
    sliced, out = _run(tmp_path, 4)
    assert [r["step"] for r in sliced] == [1, 2, 3]
    for a, b in zip(plain, sliced):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
        assert a["peak_saved_bytes"] > 0 and b["peak_saved_bytes"] > 0
    assert "peak saved for backward per rank: " in out
    assert out.split("peak saved for backward per rank: ")[1].splitlines()[0].count("MiB") == 2
