"""Signals and dying helpers while ``pp_schedule: auto`` measures the link (issue #25, class 7):
Ctrl-C ends ``pp-core run`` within seconds with nothing left running, a measuring helper killed
during ``pp-core plan`` is one clear error. Real processes; signals as a terminal sends them.

And a signal at every other phase - auto's profiling (after the link's helpers ended), the
ranks' training, a checkpoint save, ``pp-core plan`` measuring and profiling - ends the command
within seconds with 128 + the signal's number and nothing left running: SIGINT to the process
group (Ctrl-C in a terminal), SIGTERM to the command's process only (``kill PID``, a job
scheduler). A model that lingers where the test signals (its forward while the launcher profiles
it, its ``state_dict`` while a rank saves) holds each phase open, so the signal lands inside it
every time. The ranks' phases run a fixed schedule and plan's profiling skips the link
(``--no-link``): auto's measuring and profiling on the way there cost 8-10 s a case on 2 cores
and are signalled in phases of their own."""

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
from tests.cases.specs import tiny_gpt_spec

PIPE = tiny_gpt_spec(model={"args": {"num_layers": 2}},
                     pipeline={"pp_schedule": "auto", "pp_microbatch_size": None},
                     distributed={"device": "cpu"}, output={"progress": "plain"})


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


@pytest.mark.cli
@pytest.mark.ranks
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


@pytest.mark.cli
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


LINGER = """
import inspect, os, time
from pathlib import Path
from pp_core_builtins.models.gpt import GPT

def _linger(phase):
    Path(f"lingering-{phase}").touch()  # the test signals once this file exists
    for _ in range(600):
        time.sleep(0.1)

class Lingering(GPT):
    def __init__(self, linger="", **args):
        super().__init__(**args)
        self.linger = linger
        self.register_state_dict_post_hook(Lingering._saving)

    def forward(self, x, *rest, **kwargs):
        if self.linger == "profile" and "RANK" not in os.environ and x.device.type != "meta":
            _linger("profile")  # the launcher profiles the model for pp_schedule: auto
        return super().forward(x, *rest, **kwargs)

    @staticmethod
    def _saving(module, state_dict, prefix, local_metadata):
        if module.linger == "save" and any(f.function == "save_checkpoint"
                                           for f in inspect.stack()):
            _linger("save")
"""


def _lingering(tmp_path, phase: str, command: str):
    """``command`` on a 2-rank pipeline whose model lingers in ``phase``; returns the process
    once the phase has begun (a file the model writes, or the first training step)."""
    (tmp_path / "lingering_model.py").write_text(LINGER)
    pipe = {**PIPE, "model": {"target": "lingering_model:Lingering",
                              "args": {**PIPE["model"]["args"], "linger": phase}},
            "train": {"steps": 100000, "log_every": 1}}
    if phase in ("save", "training"):  # the ranks' phases: no link or profile on the way
        pipe["pipeline"] = {**PIPE["pipeline"], "pp_schedule": "1f1b"}
    if phase == "save":
        pipe["checkpoint"] = {"dir": "ckpt", "every": 2}
    # plan's profile phase straight away (--no-link): a signal after the link's helpers ended is
    # run's profile phase, a signal among them plan's measuring phase
    options = ["--no-link"] if (command, phase) == ("plan", "profile") else []
    key, value = TAG.split("=")
    env = {**os.environ, key: value, "TMPDIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(pipe))
    process = subprocess.Popen([sys.executable, "-m", "pp_core", command, "pipe.yaml", *options],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if phase == "training":
        for line in process.stdout:  # the ranks train
            if line.split()[:1] == ["step"]:
                return process
        pytest.fail(f"no training step: {process.communicate()[1][-2000:]}")
    if phase == "measuring":
        _wait_for_helpers(process)
        time.sleep(1.0)  # inside the measurement
        return process
    deadline = time.monotonic() + 120
    while not (tmp_path / f"lingering-{phase}").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"the {phase} phase never began: {process.communicate()[1][-2000:]}")
        time.sleep(0.05)
    return process


@pytest.mark.cli
@pytest.mark.ranks
@pytest.mark.parametrize("command, phase", [
    ("run", "profile"), ("run", "training"), ("run", "save"), ("plan", "measuring"),
    ("plan", "profile")])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_in_any_phase_ends_everything_at_once_with_its_exit_code(tmp_path, command,
                                                                          phase, sig):
    process = _lingering(tmp_path, phase, command)
    if sig == signal.SIGINT:
        os.killpg(process.pid, sig)  # Ctrl-C: the terminal signals the whole foreground group
    else:
        os.kill(process.pid, sig)  # `kill PID`: pp-core itself must stop what it started
    sent = time.monotonic()
    _, err = _finish(process, 30)
    assert time.monotonic() - sent < 10, err[-2000:]
    assert process.returncode == 128 + sig, err[-2000:]
    assert f"interrupted by {sig.name}" in err and "Traceback" not in err, err[-2000:]
    time.sleep(0.5)
    assert _tagged() == [], "processes outlived pp-core"
    if phase == "save":  # a save cut short leaves no checkpoint that looks complete
        assert not list((tmp_path / "ckpt").glob("step_*/.metadata")) or \
            (tmp_path / "ckpt" / "latest").exists()
