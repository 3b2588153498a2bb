"""One writer per output (issue #34, class 1): a run locks its checkpoint directory and outputs; a
second run that shares any of them is refused naming the first, and a killed run's lock is taken
over with a note. Real concurrent ``pp-core run`` processes, real locks on real files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pp_core.app.commands.run_lock import LOCK_NAME, holders, lock_files, run_locks
from pp_core.app.spec import parse_spec
from pp_core.errors import PPCoreError

from tests.cases.cli import PP_CORE
from tests.cases.specs import tiny_gpt_spec

BASE = tiny_gpt_spec(model={"args": {"dim": 8, "num_layers": 2}},
                     pipeline={"pp_schedule": None, "pp_batch_size": 2, "pp_microbatch_size": None},
                     output=None)


def _spec(tmp: Path, **sections):
    data = json.loads(json.dumps(BASE))
    for name, value in sections.items():
        data[name] = {k: str(tmp / v) if isinstance(v, str) else v for k, v in value.items()}
    return parse_spec(data, str(tmp / f"{len(sections)}.yaml"))


SHARED = [  # (the first run's places, the second run's, the key the refusal names)
    ({"checkpoint": {"dir": "ckpt"}}, {"checkpoint": {"dir": "ckpt"}}, "checkpoint.dir"),
    ({"output": {"metrics": "m.jsonl"}}, {"output": {"metrics": "m.jsonl"}}, "output.metrics"),
    ({"output": {"trace": "t.json"}, "checkpoint": {"dir": "a"}},
     {"output": {"trace": "t.json"}, "checkpoint": {"dir": "b"}}, "output.trace"),
    ({"output": {"metrics": "runs/m.jsonl"}}, {"output": {"metrics": "runs/./m.jsonl"}},
     "output.metrics"),
]


@pytest.mark.parametrize("first, second, key", SHARED, ids=[s[2] + str(i) for i, s in
                                                            enumerate(SHARED)])
def test_a_second_run_sharing_a_place_is_refused_naming_the_first(tmp_path, first, second, key):
    notes: list[str] = []
    with run_locks(_spec(tmp_path, **first), notes):
        with pytest.raises(PPCoreError) as refused:
            with run_locks(_spec(tmp_path, **second), notes):
                pass
        message = str(refused.value)
        assert message.startswith(f"{key}: ") and "is being written by another pp-core run: " \
            f"pid {os.getpid()} on host {socket.gethostname()} (pipeline " in message, message
        assert f"give this run another {key}" in message
        assert any(key in line for line in holders(_spec(tmp_path, **second)))
    assert notes == [] and not list(tmp_path.rglob(f"*{LOCK_NAME}"))  # released and removed


@pytest.mark.cli
def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_note(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    spec = _spec(tmp_path, checkpoint={"dir": "ckpt"}, output={"metrics": "m.jsonl"})
    for _, lock in lock_files(spec):
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.write_text(json.dumps({"pid": int(dead), "host": socket.gethostname(),
                                    "pipeline": "old.yaml", "started": "yesterday"}))
    notes: list[str] = []
    with run_locks(spec, notes):
        held = json.loads((tmp_path / "ckpt" / LOCK_NAME).read_text())
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    assert [n.split(":")[0] for n in notes] == ["checkpoint.dir", "output.metrics"]
    assert all(f"of a run that is no longer running (pid {dead} on host "
               f"{socket.gethostname()} (pipeline old.yaml, started yesterday))" in n
               for n in notes), notes


PIPE = """\
model: {name: gpt, args: {vocab_size: 32, dim: 8, num_layers: 2, num_heads: 2, max_seq_len: 8}}
data: {name: synthetic, args: {seq_len: 8, vocab_size: 32}}
pipeline: {pp_batch_size: 2, loss_fn: cross_entropy}
distributed: {pp_size: 2}
train: {steps: 100000, log_every: 1000}
checkpoint: {dir: ckpt, every: 1000000, save_final: false}
output: {metrics: m.jsonl, progress: off, summary: false}
"""


@pytest.mark.cli
@pytest.mark.ranks
def test_concurrent_runs_of_one_pipeline_one_refused_then_a_killed_ones_lock_taken_over(
        tmp_path, monkeypatch, capsys):
    """The first run is the command in a process of its own (killed, it leaves its lock); the
    second and third are the command in this process (:func:`pp_core.app.cli.main`), a run as
    real to the lock as another process: its own pid, its ranks forked warm."""
    from pp_core.app import cli

    (tmp_path / "pipe.yaml").write_text(PIPE)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    first = subprocess.Popen([PP_CORE, "run", "pipe.yaml"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # a pipeline's folder joins it
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "ckpt" / LOCK_NAME).exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        capsys.readouterr()
        assert cli.main(["run", "pipe.yaml"]) == 1
        second = capsys.readouterr()
        assert first.poll() is None  # the first one still trains
        assert second.out == "", second.out + second.err
        assert second.err == (
            f"pp-core: error: checkpoint.dir: '{tmp_path / 'ckpt'}' is being written by another "
            f"pp-core run: "
            f"pid {first.pid} on host {socket.gethostname()} (pipeline pipe.yaml, started "
            f"{json.loads((tmp_path / 'ckpt' / LOCK_NAME).read_text())['started']}); wait for "
            f"it to end or stop it, or give this run another checkpoint.dir (lock file "
            f"'{tmp_path / 'ckpt' / LOCK_NAME}')\n")
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)  # the launcher and its ranks, no cleanup at all
        first.communicate()
    code = cli.main(["run", "pipe.yaml", "--set", "train.steps=2"])
    third = capsys.readouterr()
    assert code == 0, third.out + third.err
    notes = [line for line in third.out.splitlines() if "took over" in line]
    assert [n.split(": ")[2] for n in notes] == ["checkpoint.dir", "output.metrics"], third.out
    assert all(f"no longer running (pid {first.pid} on host" in n for n in notes), notes
    assert not list(tmp_path.rglob(f"*{LOCK_NAME}"))
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]  # one run's whole lines
