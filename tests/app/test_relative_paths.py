"""One rule for relative paths: a pipeline file's are relative to its folder, whoever runs it.

A LoRA fine-tune of a tiny Hugging Face Llama kept in folder A - its ``save_pretrained``
directory, tokenizer, corpus, token cache, checkpoints and metrics all named relative to A - is
validated, run, resumed and exported from folder B; what the checkpoint records about its inputs
is absolute, and the exported adapter, whose ``base_model_name_or_path`` is absolute, loads with
``AutoPeftModelForCausalLM`` from a third folder (offline: nothing may be downloaded).

The two runs are the command end to end from folder B (the launcher's and the ranks' working
directory, where nothing may land); validate, export and the adapter's load run in this process
from B and C (``chdir``), which is what they check, without an interpreter importing
transformers for each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pp_core.checkpoint.record import read_section

from tests.cases.cli import PP_CORE

pytest.importorskip("peft")
pytest.importorskip("tokenizers")

PIPELINE = """\
model:
  name: hf_causal_lm
  args: {config: base}
  lora: {r: 4, alpha: 8, target_modules: [q_proj, v_proj]}
data:
  name: tokenized_text
  args: {files: [corpus.txt], tokenizer: tok, seq_len: 16, cache_dir: cache}
pipeline: {pp_schedule: 1f1b, pp_batch_size: 4, pp_microbatch_size: 2,
           loss_fn: cross_entropy}
distributed: {pp_size: 2, device: cpu}
train: {steps: 2, log_every: 1}
checkpoint: {dir: ckpt, every: 2}
output: {progress: plain, summary: false, metrics: runs/metrics.jsonl}
"""

def _pp_core(cwd, *args):
    done = subprocess.run([PP_CORE, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _here(monkeypatch, capsys, cwd, *args):
    """``pp-core ARGS`` run from ``cwd`` in this process (:func:`pp_core.app.cli.main`)."""
    from pp_core.app import cli

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))  # a pipeline's folder joins it
    code = cli.main(list(args))
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    return captured.out + captured.err


def _offline(monkeypatch):
    """Nothing may be downloaded: Hugging Face's offline switch, read when it was imported."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.cli
@pytest.mark.ranks(2)
def test_a_pipeline_folder_runs_resumes_and_exports_from_elsewhere(tmp_path, monkeypatch,
                                                                     capsys):
    from tests.cases.hf import tiny_model
    from tests.data.test_tokenized_text import DEFAULT_TEXT, train_tokenizer

    a, b, c = (tmp_path / name for name in ("A", "B", "C"))
    for folder in (a, b, c):
        folder.mkdir()
    tiny_model("llama", 2, vocab_size=128).save_pretrained(str(a / "base"))
    train_tokenizer(a / "tok")
    (a / "corpus.txt").write_text(DEFAULT_TEXT.read_text()[:20_000])
    (a / "pipe.yaml").write_text(PIPELINE)
    _offline(monkeypatch)

    assert "ok" in _here(monkeypatch, capsys, b, "validate", "../A/pipe.yaml")
    _pp_core(b, "run", "../A/pipe.yaml")
    assert (a / "ckpt" / "step_00000002").is_dir() and (a / "runs" / "metrics.jsonl").is_file()
    assert (a / "cache").is_dir() and not any(b.iterdir())  # nothing lands in B

    out = _pp_core(b, "run", "../A/pipe.yaml", "--set", "train.steps=3",
                   "--set", "checkpoint.resume=ckpt/step_00000002")
    assert f"resumed from {a / 'ckpt' / 'step_00000002'} (step 2)" in out, out
    record = read_section(a / "ckpt" / "step_00000003", "run")
    assert record["model"]["args"]["config"] == str(a / "base")

    _here(monkeypatch, capsys, b, "export", "../A/ckpt", "--format", "hf", "-o", "../C/adapter")
    adapter = json.loads((c / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(a / "base")
    assert not any(b.iterdir())  # nor from the export

    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(c)
    model = AutoPeftModelForCausalLM.from_pretrained("adapter")
    assert (type(model).__name__, model.peft_config["default"].base_model_name_or_path) == \
        ("PeftModelForCausalLM", str(a / "base"))


MODEL_BESIDE = """\
import torch

def build(weights: str, size: int = 4):
    return torch.nn.Linear(size, size)

build.pp_path_args = ("weights",)
"""


def test_every_relative_path_of_a_file_is_made_absolute_against_its_folder(tmp_path,
                                                                           monkeypatch):
    """The schema's paths, ``--set`` values, a ``model.target`` beside the file (importable, its
    declared path argument resolved), a dataset's declared paths but not its words
    (``tokenizer: bytes``); absolute paths and a folder's trailing separator kept."""
    from pp_core.app.spec import load_spec
    from tests.cases.specs import tiny_gpt_spec, write_spec

    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir(), b.mkdir()
    (a / "beside_mod.py").write_text(MODEL_BESIDE)
    write_spec(a / "pipe.yaml", tiny_gpt_spec(
        model={"name": None, "target": "beside_mod:build", "args": {"weights": "w.pt"}},
        data={"name": "tokenized_text", "args": {"files": ["c/*.txt"], "tokenizer": "bytes",
                                                 "cache_dir": "cache"},
              "eval_args": {"files": "/abs/eval.txt"}},
        pipeline={"pp_schedule_csv": "order.csv"},
        checkpoint={"dir": "ckpt", "resume": "old/step_00000002",
                    "export_hf": {"dir": "hf", "every": 2}},
        output={"metrics": "runs/m.jsonl", "tensorboard": "tb/", "progress": "plain"}))
    monkeypatch.chdir(b)
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = load_spec("../A/pipe.yaml", ["output.trace=t.json"])
    assert spec.model.args["weights"] == str(a / "w.pt")
    assert {k: spec.data.args[k] for k in ("files", "tokenizer", "cache_dir")} == {
        "files": [str(a / "c/*.txt")], "tokenizer": "bytes", "cache_dir": str(a / "cache")}
    assert spec.data.eval_args == {"files": "/abs/eval.txt"}
    assert spec.pipeline.pp_schedule_csv == str(a / "order.csv")
    assert (spec.checkpoint.dir, spec.checkpoint.resume, spec.checkpoint.export_hf) == (
        str(a / "ckpt"), str(a / "old/step_00000002"), {"dir": str(a / "hf"), "every": 2})
    assert (spec.output.metrics, spec.output.trace, spec.output.tensorboard) == (
        str(a / "runs/m.jsonl"), str(a / "t.json"), str(a / "tb") + os.sep)
    assert spec.source == "../A/pipe.yaml" and sys.path[-1] == str(a)
