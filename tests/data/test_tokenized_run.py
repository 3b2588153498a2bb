"""``pp-core run examples/tokenized.yaml`` with a tokenizer trained in the test (saved to a temp
dir, nothing downloaded): packed rows whose microbatches hold uneven numbers of valid targets.
One microbatch per step and eight give the same losses (the token-exact loss), and a run resumed
mid-epoch from a checkpoint gives the uninterrupted run's losses (the dataset's ``skip``).
metrics.jsonl and the summary count valid tokens, padding and documents; ``output.tensorboard``
writes TensorBoard events."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cases.specs import ROOT, pp_core
from tests.data.test_tokenized_text import train_tokenizer

pytest.importorskip("tokenizers")


def losses(path: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def run(tmp_path, name: str, *sets: str, capsys=None) -> dict[int, float]:
    """``pp-core run`` of the example: the command end to end, or with ``capsys`` through
    :func:`pp_core.app.cli.main` in this process (its ranks forked warm)."""
    tokenizer = tmp_path / "tokenizer"
    if not tokenizer.is_dir():
        train_tokenizer(tokenizer)
    metrics = tmp_path / name / "metrics.jsonl"
    args = [f"data.args.tokenizer={tokenizer}", f"data.args.cache_dir={tmp_path / 'cache'}",
            "model.args.vocab_size=128", "model.args.dim=32", "data.args.seq_len=32",
            "train.steps=4", "train.log_every=1", "train.eval_every=null", "train.warmup_steps=0",
            "output.progress=plain", f"output.metrics={metrics}", *sets]
    argv = ["run", "examples/tokenized.yaml", *[x for a in args for x in ("--set", a)]]
    if capsys is not None:
        from pp_core.app import cli

        argv[1] = str(ROOT / argv[1])
        argv += ["--set", "distributed.device=cpu"]  # as the command's hidden CUDA devices
        capsys.readouterr()
        assert cli.main(argv) == 0, capsys.readouterr().err[-3000:]
    else:  # the ranks' summary reaches the command's stdout (a warm rank's is the fork server's)
        result = pp_core(*argv, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert result.returncode == 0, result.stderr[-3000:]
        assert "documents/step" in result.stdout  # the summary's data line
    return losses(metrics)


@pytest.mark.cli
@pytest.mark.ranks
def test_microbatches_do_not_change_the_loss_and_resume_is_exact(tmp_path, capsys):
    """Two runs: eight microbatches a step, saving at step 2; then one microbatch a step,
    resumed from that checkpoint mid-epoch. The resumed run's steps 3 and 4 are the first run's:
    the same batches (the dataset's ``skip``) and the same loss however they are cut. The first
    run is the command end to end, the resume goes through cli.main in this process."""
    checkpoints = tmp_path / "a" / "checkpoints"
    eight = run(tmp_path, "a", "pipeline.pp_microbatch_size=1", f"checkpoint.dir={checkpoints}",
                "checkpoint.every=2", "checkpoint.save_final=false")
    assert sorted(eight) == [1, 2, 3, 4]
    saved = sorted(p for p in checkpoints.iterdir() if p.is_dir())
    assert len(saved) == 2, saved
    try:  # the tensorboard extra (scripts/setup-env.sh installs it)
        import tensorboard  # noqa: F401
        board = [f"output.tensorboard={tmp_path / 'tb'}"]
    except ImportError:
        board = []
    one = run(tmp_path, "b", "pipeline.pp_microbatch_size=8", f"checkpoint.resume={saved[0]}",
              "checkpoint.dir=null", *board, capsys=capsys)
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    for line in (x for x in lines if "loss" in x):  # figures of the data, counted as the loss
        assert 0 <= line["padding_fraction"] < 0.5 and line["docs"] >= 8, line
        assert 0 < line["valid_tokens_per_s"] <= line["tokens_per_s"], line
        # the one batch holds all of the step's valid tokens: valid share = 1 - padding
        ratio = line["valid_tokens_per_s"] / line["tokens_per_s"]
        assert abs(ratio - (1 - line["padding_fraction"])) < 1e-3, line
    if board:
        assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "no TensorBoard events"
    assert sorted(one) == [3, 4]
    for step in (3, 4):
        assert abs(one[step] - eight[step]) <= 1e-5, (step, one, eight)
