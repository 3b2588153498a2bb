"""``pp-core validate`` builds what ``run`` builds: every mistake a rank would meet after starting
(model and data arguments, the optimizer, dtype, seed, resume path, output paths, sizes) is
refused before any process starts, with the YAML key and the fix. Table-driven, in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pp_core.app import cli
from pp_core.app.spec import apply_overrides
from tests.cases.specs import tiny_gpt_spec

ROOT = Path(__file__).resolve().parents[2]

BASE = tiny_gpt_spec(model={"args": {"vocab_size": None, "dim": 32, "num_layers": 2,
                                              "num_heads": 4, "max_seq_len": 16}},
                     data={"args": {"seq_len": 16, "vocab_size": None}}, train={"steps": 3},
                     output=None)


def validate(tmp_path, capsys, *overrides: str, data: dict | None = None) -> tuple[int, str]:
    """``pp-core validate`` of BASE with ``--set`` overrides: (exit code, stdout + stderr)."""
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(apply_overrides(data or BASE, [])))
    args = ["validate", str(path)]
    for item in overrides:
        args += ["--set", item]
    code = cli.main(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_base_file_validates(tmp_path, capsys):
    code, text = validate(tmp_path, capsys)
    assert code == 0, text


@pytest.mark.parametrize("overrides, expected", [
    # model arguments the factory rejects
    (("model.args.num_heads=5",), "model.args: the model factory refused these arguments "
                                  "(ValueError: dim=32 is not divisible by num_heads=5)"),
    (("model.args.dim=wide",), "model.args: the model factory refused these arguments"),
    (("model.args.dim=-8",), "model.args: the model factory refused these arguments"),
    # data arguments
    (("data.args.seq_len=0",), "data.args: the dataset yields an empty batch (inputs of "
                               "shape (4, 0))"),
    (("data.args.seq_len=32",), "data.args: a microbatch of this data fails in the model"),
    (("data.name=text_bytes", "data.args.path=/no/such/text.txt"),
     "data.args: dataset 'text_bytes' refused these arguments (FileNotFoundError"),
    (("data.args.seq_lne=16",), "data.args: dataset 'synthetic' refused these arguments "
                                "(TypeError"),
    (("train.eval_every=1", "data.eval_args.split=val"),
     "data.eval_args: dataset 'synthetic' refused these arguments (train.eval_every is set"),
    # optimizer arguments
    (("train.optimizer.lr=-1",), "train.optimizer: torch.optim.AdamW refused these arguments "
                                 "(ValueError: Invalid learning rate"),
    (("train.optimizer.betas=[2.0, 0.9]",), "train.optimizer: torch.optim.AdamW refused"),
    (("train.optimizer={name: LBFGS}",), "train.optimizer.name: torch.optim.LBFGS needs a "
                                         "closure"),
    # dtype, seed, resume
    (("pipeline.dtype=int64",), "pipeline.dtype: dtype='int64' is not a floating-point dtype"),
    (("train.seed=18446744073709551616",), "train.seed: expected an int in [0, "
                                           "18446744073709551615]"),
    (("checkpoint.dir=CKPT", "checkpoint.resume=/no/such/step_00000001"),
     "checkpoint.resume: '/no/such/step_00000001' does not exist"),
    # silently accepted nonsense
    (("train.min_lr_ratio=.nan", "train.lr_decay=cosine"),
     "train.min_lr_ratio: expected a finite number in [0.0, 1.0], found nan"),
    (("train.grad_clip=.nan",), "train.grad_clip: expected a finite number >= 0.0, found nan"),
    (("distributed.dp_size=100000",), "distributed.dp_size: pp_size * dp_size / nnodes = 2 * "
                                      "100000 / 1 = 200,000 processes on this machine"),
    # sequence parallelism shards the sequence: its length divides by tp_size
    (("distributed.tp_size=2", "distributed.sequence_parallel=true", "data.args.seq_len=15",
      "distributed.pp_size=1"),
     "distributed.sequence_parallel: shards the sequence over the tp_size=2 ranks, but the "
     "dataset yields sequences of 15"),
    # smaller ones
    (("model.name=null", "model.target=os:system", "model.args={}"),
     "model.target: model.target='os:system' names a builtin_function_or_method, not a class "
     "or a Python function"),
    (("pipeline.loss_fn=cross_entropi", "pipeline.pp_microbatch_size=2"),
     "pipeline.loss_fn: unknown loss 'cross_entropi'"),
])
def test_refused_before_any_process_starts(tmp_path, capsys, overrides, expected):
    overrides = [o.replace("CKPT", str(tmp_path / "ckpt")) for o in overrides]
    code, text = validate(tmp_path, capsys, *overrides)
    assert code == 1, text
    assert expected in text, text
    assert "Traceback" not in text


def test_a_negative_batch_size_gives_no_nonsense_hint(tmp_path, capsys):
    code, text = validate(tmp_path, capsys, "pipeline.pp_batch_size=-4",
                          "pipeline.pp_microbatch_size=2")
    assert code == 1 and "pipeline.pp_batch_size: expected a positive int, found -4" in text
    assert "or 2" not in text, text


@pytest.mark.parametrize("key", ["checkpoint.dir", "output.metrics", "output.trace",
                                 "output.schedule_image"])
def test_an_output_under_a_regular_file_is_refused(tmp_path, capsys, key):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    code, text = validate(tmp_path, capsys, f"{key}={blocker}/sub/out")
    assert code == 1, text
    assert f"{key}: cannot create '{blocker}/sub/out': '{blocker}' is a file, not a " \
           f"directory" in text, text
    assert blocker.read_text() == "not a directory" and not (tmp_path / "sub").exists()


def test_a_file_where_a_directory_is_expected_and_the_reverse(tmp_path, capsys):
    (tmp_path / "ckpt").write_text("")
    (tmp_path / "metrics").mkdir()
    code, text = validate(tmp_path, capsys, f"checkpoint.dir={tmp_path}/ckpt",
                          f"output.metrics={tmp_path}/metrics")
    assert code == 1, text
    assert f"checkpoint.dir: '{tmp_path}/ckpt' is a file, expected a directory" in text
    assert f"output.metrics: '{tmp_path}/metrics' is a directory, expected a file" in text


def test_outputs_leave_nothing_behind_and_an_existing_file_is_named(tmp_path, capsys):
    (tmp_path / "old.jsonl").write_text("old run\n")
    code, text = validate(tmp_path, capsys, f"output.metrics={tmp_path}/old.jsonl",
                          f"output.trace={tmp_path}/new/dir/trace.json",
                          f"checkpoint.dir={tmp_path}/ckpts")
    assert code == 0, text
    assert f"note: output.metrics: '{tmp_path}/old.jsonl' exists and will be replaced" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl", "pipe.yaml"]


def test_an_exported_interleaved_csv_validates_without_layers_per_stage(tmp_path, capsys):
    order = tmp_path / "order.csv"
    assert cli.main(["schedule", "export", "interleaved_1f1b", "--pp", "2", "--microbatches",
                     "4", "-o", str(order)]) == 0
    code, text = validate(tmp_path, capsys, f"pipeline.pp_schedule_csv={order}",
                          "model.args.num_layers=4")
    assert code == 0, text
    assert "4 stages (2 ranks x 2)" in text, text


@pytest.mark.cli
def test_a_missing_optional_dependency_names_the_extra(tmp_path):
    """A machine without transformers: the import is blocked before pp-core starts."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nsys.modules['transformers'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(blocker)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    found = subprocess.run([sys.executable, "-m", "pp_core", "validate",
                            str(ROOT / "examples" / "hf_llama.yaml")],
                           capture_output=True, text=True, env=env, timeout=300)
    assert found.returncode == 1, found.stdout + found.stderr
    assert "model.name: model 'hf_causal_lm' needs Hugging Face transformers" in found.stderr
    assert "pip install 'pp-core-torch[transformers]'" in found.stderr
    assert "Traceback" not in found.stderr


def test_run_refuses_an_unwritable_checkpoint_dir_before_starting_ranks(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    code = cli.main(["run", str(path), "--set", f"checkpoint.dir={blocker}/ckpt"])
    out = capsys.readouterr()
    assert code == 1 and "starting" not in out.out, out
    assert out.err.count("\n") == 1 and f"checkpoint.dir: cannot create '{blocker}/ckpt': " \
        f"'{blocker}' is a file, not a directory; choose another path" in out.err, out.err


def test_validate_help_says_it_calls_the_code_a_file_names(capsys):
    with pytest.raises(SystemExit):
        cli.main(["validate", "--help"])
    assert "validate imports and calls the code the file names" in capsys.readouterr().out


def test_a_checkpoint_dir_with_an_earlier_run_is_named(tmp_path, capsys):
    step = tmp_path / "ckpt" / "step_00000020"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    code, text = validate(tmp_path, capsys, f"checkpoint.dir={tmp_path}/ckpt")
    assert code == 0, text
    assert "holds checkpoints up to step_00000020; this run starts at step 0" in text, text
    code, text = validate(tmp_path, capsys, f"checkpoint.dir={tmp_path}/ckpt",
                          "checkpoint.resume=true")
    # Resuming reads that checkpoint, so validate checks it: an empty .metadata is a damaged one.
    assert code == 1 and "holds checkpoints" not in text, text
    assert "checkpoint.resume: checkpoint " in text and "is incomplete or corrupt" in text, text


def test_more_microbatches_than_any_step_needs_are_refused_at_once(tmp_path, capsys):
    code, text = validate(tmp_path, capsys, "pipeline.pp_batch_size=1000000000")
    assert code == 1 and "pipeline.pp_batch_size: pp_batch_size / pp_microbatch_size = " \
        "1,000,000,000 / 1 = 1,000,000,000 microbatches per step, more than 16,384" in text, text


def test_a_pp_seq_len_the_data_does_not_have_is_a_note(tmp_path, capsys):
    """pp_seq_len is a hint (NeMo): another length still runs, so validate notes it."""
    code, text = validate(tmp_path, capsys, "pipeline.pp_seq_len=8")
    assert code == 0, text
    assert "note: pipeline.pp_seq_len: pp_seq_len=8 is a hint, but the dataset yields sequence " \
           "length 16" in text, text
