"""Real runs for issue #34's fixes: packed rows with sequence parallelism train on the demo GPT
(the position embedding's plan assumed unbatched positions). That a NaN stop prints its message
and no traceback after it is checked by the NaN run of tests/app/test_training_health.py."""

from __future__ import annotations

import json

import pytest
import yaml

ARGS = {"vocab_size": 256, "dim": 32, "num_layers": 2, "num_heads": 2, "max_seq_len": 16}


def _run(tmp_path, values) -> int:
    """``pp-core run`` through :func:`pp_core.app.cli.main` in this process, its ranks forked warm
    (what is checked is the training, not the command's own interpreter)."""
    from pp_core.app import cli

    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(values))
    return cli.main(["run", str(tmp_path / "pipe.yaml")])


@pytest.mark.cli
@pytest.mark.ranks
def test_packed_rows_with_sequence_parallel_train_the_demo_gpt(tmp_path, capsys):
    (tmp_path / "corpus.jsonl").write_text("\n".join(
        json.dumps({"text": f"document {i}: a few words of text to pack."}) for i in range(64)))
    code = _run(tmp_path, {
        "model": {"name": "gpt", "args": ARGS},
        "data": {"name": "tokenized_text", "args": {"files": ["corpus.jsonl"], "tokenizer": "bytes",
                                                    "seq_len": 16, "pack": True,
                                                    "cache_dir": "cache"}},
        "pipeline": {"pp_schedule": "gpipe", "pp_batch_size": 4, "pp_microbatch_size": 2,
                     "loss_fn": "cross_entropy"},
        "distributed": {"pp_size": 1, "tp_size": 2, "sequence_parallel": True, "device": "cpu"},
        "train": {"steps": 2},
        "output": {"progress": "off", "summary": False, "metrics": "metrics.jsonl"}})
    assert code == 0, capsys.readouterr().err[-3000:]
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses), losses
