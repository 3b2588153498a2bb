"""Signals and dying helpers while ``pp_schedule: auto`` measures the link (issue #25, class 7):
Ctrl-C ends ``pp-core run`` within seconds with nothing left running, a measuring helper killed
during ``pp-core plan`` is one clear error. Real processes; signals as a terminal sends them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

PIPE = {
    "model": {"name": "gpt", "args": {"dim": 16, "num_layers": 2, "num_heads": 2,
                                      "max_seq_len": 8, "vocab_size": 32}},
    "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 32}},
    "pipeline": {"pp_schedule": "auto", "pp_batch_size": 4, "loss_fn": "cross_entropy"},
    "distributed": {"pp_size": 2, "device": "cpu"},
    "train": {"steps": 2},
    "output": {"progress": "plain", "summary": False},
}


def _tagged() -> list[int]:
    """Processes carrying this test run's tag in their environment (the run and its helpers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if TAG.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


TAG = f"PP_CORE_TEST_TAG={uuid.uuid4().hex}"


def _helpers(parent: int) -> list[int]:
    """The link-measuring helpers: spawned children of ``parent`` running spawn_main."""
    found = []
    for pid in _tagged():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == parent and b"spawn_main" in cmdline:
            found.append(pid)
    return found


def _start(tmp_path, *command):
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(PIPE))
    key, value = TAG.split("=")
    return subprocess.Popen([sys.executable, "-m", "pp_core", *command, "pipe.yaml"],
                            cwd=tmp_path, env={**os.environ, key: value, "TMPDIR": str(tmp_path),
                                               "CUDA_VISIBLE_DEVICES": ""},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # a terminal's process group: Ctrl-C hits all
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_helpers(process, limit: float = 120) -> list[int]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and process.poll() is None:
        helpers = _helpers(process.pid)
        if len(helpers) == 2:
            return helpers
        time.sleep(0.05)
    out, err = process.communicate(timeout=30) if process.poll() is None else process.communicate()
    pytest.fail(f"no measuring helpers appeared: {out[-1000:]} {err[-2000:]}")


def _finish(process, timeout: float):
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"still running {timeout} s after the signal: {err[-2000:]}")


def test_ctrl_c_while_auto_measures_the_link_ends_everything(tmp_path):
    process = _start(tmp_path, "run")
    _wait_for_helpers(process)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("pp-core-link-*/store")) and time.monotonic() < deadline:
        time.sleep(0.05)  # the helpers' store: they are joining, then measuring
    time.sleep(1.0)  # inside the measurement's collectives
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    sent = time.monotonic()
    _, err = _finish(process, 30)
    assert time.monotonic() - sent < 15, err[-2000:]
    assert process.returncode == 130 and "interrupted by SIGINT" in err, err[-2000:]
    time.sleep(0.5)
    assert _tagged() == [], "processes outlived pp-core"


def test_a_helper_killed_during_plan_is_one_clear_error(tmp_path):
    process = _start(tmp_path, "plan")
    helpers = _wait_for_helpers(process)
    os.kill(helpers[1], signal.SIGKILL)
    _, err = _finish(process, 60)
    assert process.returncode == 1, err[-2000:]
    assert "a link-measuring helper process ended before it finished" in err and \
        "--no-link" in err and "Traceback" not in err, err[-2000:]
    time.sleep(0.5)
    assert _tagged() == [], "processes outlived pp-core"
