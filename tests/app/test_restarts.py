"""Runs that outlive their ranks (docs/failures.md): ``distributed.max_restarts`` restarts every
rank after one is killed by a real SIGKILL, each resumes from the latest complete checkpoint, and
the run ends rc 0 with the losses of a run that never failed - with synchronous and with
``checkpoint.async`` saves (there killed in the middle of a background write), and after a
SIGSTOP (a hung rank, replaced after ``distributed.timeout_s``); failures beyond
``max_restarts`` end the run with one message; the restart keys' refusals, checked in-process.

pp 2 x dp 2 tiny GPT, a checkpoint every 4 steps; rank 1 kills itself (``os.kill(SIGKILL)``) as
step 7 begins, so the restarted ranks resume at step 4 and run steps 5 and 6 again. One
uninterrupted run is the reference of both restarted ones.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from pp_core.app.spec import SpecError, parse_spec
from pp_core_builtins.models import GPT
from tests.cases.specs import ROOT, pp_core, tiny_gpt_spec, write_spec

MICROBATCHES = 4  # forwards of one step on each rank (pp_batch_size 4 / pp_microbatch_size 1)
_CALLS = [0]


class Killer(GPT):
    """``PP_TEST_KILL=RANK:STEPS:SIGNAL:once|every``: that rank sends itself the signal as its
    attempt's step ``STEPS + 1`` begins - in the first attempt only, or in every attempt;
    ``RANK:STEPS:SIGNAL:save``: in the first attempt, as its background writer is half-way
    through the first file of the checkpoint of step ``STEPS`` (DCP's thread, in flight)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        rank, steps, name, when = (os.environ.get("PP_TEST_KILL") or "-:0:-:-").split(":")
        if when == "save" and os.environ.get("RANK") == rank and \
                os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            _kill_in_write(f"step_{int(steps):08d}.tmp-", getattr(signal, name))

    def forward(self, x):
        _CALLS[0] += 1
        rank, steps, name, when = (os.environ.get("PP_TEST_KILL") or "-:0:-:-").split(":")
        if os.environ.get("RANK") == rank and _CALLS[0] == int(steps) * MICROBATCHES + 1 and \
                (when == "every" or when == "once" and
                 os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
            os.kill(os.getpid(), getattr(signal, name))
        return super().forward(x)


def _kill_in_write(staging: str, signum: int) -> None:
    """This rank's checkpoint writes (pp-core's hashing stream, under DCP's writer) send the
    signal half-way through the first file written into a staging directory named ``staging``."""
    import threading

    from pp_core.checkpoint import checksums

    write = checksums._HashingStream.write

    def torn(stream, data):
        if staging in str(getattr(stream.raw, "name", "")):
            view = memoryview(data).cast("B")
            stream.raw.write(view[:view.nbytes // 2])
            stream.raw.flush()
            assert threading.current_thread() is not threading.main_thread()  # in flight
            os.kill(os.getpid(), signum)
        return write(stream, data)

    checksums._HashingStream.write = torn


def _run(tmp, name: str, kill: str | None = None, *overrides: str):
    spec = tiny_gpt_spec(model={"name": None, "target": f"{__name__}:Killer"},
                         distributed={"dp_size": 2, "device": "cpu", "max_restarts": 2},
                         train={"steps": 8, "log_every": 1},
                         checkpoint={"dir": str(tmp / name), "every": 4},
                         output={"metrics": str(tmp / f"{name}.jsonl"), "progress": "plain",
                                 "summary": True})
    path = write_spec(tmp / f"{name}.yaml", spec)
    env = {key: value for key, value in os.environ.items() if key != "PP_CORE_TIMEOUT"}
    env.update(PYTHONPATH=str(ROOT), PP_TEST_KILL=kill or "", TMPDIR=str(tmp))
    result = pp_core("run", str(path), *[f"--set={o}" for o in overrides], env=env, timeout=180)
    lines = [json.loads(line) for line in (tmp / f"{name}.jsonl").read_text().splitlines()] \
        if (tmp / f"{name}.jsonl").is_file() else []
    return result, lines


def _losses(lines) -> dict[int, float]:
    """The last logged loss of every step."""
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


@pytest.fixture
def reference(uninterrupted_losses):
    """The uninterrupted run's losses (tests/app/conftest.py: one run shared with test_shrink)."""
    return uninterrupted_losses


@pytest.mark.cli
@pytest.mark.ranks
@pytest.mark.parametrize("saves", ["sync", "async", "stopped"])
def test_a_killed_rank_restarts_the_run_which_ends_with_the_uninterrupted_losses(
        tmp_path, reference, saves):
    """With ``checkpoint.async``, rank 1 is killed as its background writer is half-way through
    the checkpoint of step 8: the previous one (step 4, its checksums verified as it loads) is
    the one resumed, and steps 5..8 are done again. ``stopped``: rank 1 is SIGSTOPped as step 7
    begins; its peers' waits end after ``distributed.timeout_s`` (4 s), the agent SIGKILLs it 5 s
    after SIGTERM, and the group restarts (~10 s more than a kill)."""
    overrides = {"sync": [], "async": ["checkpoint.async=true"],
                 "stopped": ["distributed.timeout_s=4"]}[saves]
    kill, failed = ("1:8:SIGKILL:save", 8) if saves == "async" else \
        (f"1:6:{'SIGSTOP' if saves == 'stopped' else 'SIGKILL'}:once", 6)
    result, lines = _run(tmp_path, "killed", kill, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(lines)
    assert sorted(losses) == list(range(1, 9))
    assert losses == pytest.approx(reference, abs=1e-6, rel=0)
    restart = [line for line in lines if line.get("event") == "restart"]
    assert len(restart) == 1 and restart[0]["resumed_from"] == 4
    assert restart[0]["failed_after_step"] == failed and restart[0]["steps_redone"] == failed - 4
    assert f"restart 1 of 2: every rank was started again after a failure and resumed at step " \
           f"4; steps 5..{failed} are done again" in result.stdout
    assert f"  restarts 1: {failed - 4} step(s) redone; goodput " in result.stdout
    assert (tmp_path / "killed" / "step_00000008" / ".metadata").is_file()
    if saves == "async":
        from pp_core.checkpoint.checksums import verify_checkpoint

        assert "written in the background" in result.stdout
        assert "resumed from " + str(tmp_path / "killed" / "step_00000004") in result.stdout
        for step in (4, 8):  # the resumed one and the one the restart wrote again, checksummed
            verify_checkpoint(tmp_path / "killed" / f"step_{step:08d}")
        assert any(line.get("event") == "checkpoint" for line in lines)


@pytest.mark.cli
@pytest.mark.ranks
def test_failures_beyond_max_restarts_end_the_run_with_one_message(tmp_path):
    result, _ = _run(tmp_path, "doomed", "1:1:SIGKILL:every")
    assert result.returncode == 1
    assert result.stderr == (
        "pp-core: error: rank 1 failed: the process exited with code -9 (killed by SIGKILL); "
        "the other ranks were stopped; the run ended after 2 restart(s), all that "
        "distributed.max_restarts allows\n")


@pytest.mark.parametrize("distributed, checkpoint, message", [
    ({"max_restarts": -1}, {}, "distributed.max_restarts: expected an int >= 0, found -1 (int)"),
    ({"max_restarts": "2"}, {}, "distributed.max_restarts: expected an int >= 0, found '2' (str)"),
    ({"max_restarts": 2}, {},
     "distributed.max_restarts: 2 restarts resume from the latest checkpoint, found "
     "checkpoint.dir unset (nothing to restart from); add checkpoint.dir: <path> and "
     "checkpoint.every: N"),
    *[({"nnodes": bad}, {}, f"distributed.nnodes: expected a positive int, or 'MIN:MAX' with "
                            f"1 <= MIN <= MAX (torchrun's form), found '{bad}' (str)")
      for bad in ("3:1", "a:b", "0:2")],
    ({"nnodes": "1:2", "pp_size": 4, "master_port": 29500}, {"dir": "c"},
     "distributed.nnodes: '1:2' may leave 1 node(s) x 2 process(es) = 2 ranks, fewer than one "
     "pipeline replica needs (pp_size x tp_size x ep_size = 4); raise MIN to 2"),
    ({"nnodes": "1:2", "dp_size": 2, "master_port": 29500}, {},
     "distributed.nnodes: '1:2' lets the run go on with fewer nodes from the latest "
     "checkpoint, found checkpoint.dir unset (nothing to go on from); add checkpoint.dir: "
     "<path>"),
])
def test_restart_keys_are_refused_before_start_naming_the_key(distributed, checkpoint, message):
    with pytest.raises(SpecError) as found:
        parse_spec(tiny_gpt_spec(distributed=distributed, checkpoint=checkpoint))
    assert found.value.problems == [message]


def test_a_restart_resumes_only_a_checkpoint_this_launch_saved(tmp_path, monkeypatch):
    """An older run's checkpoint in checkpoint.dir is not resumed after a failure of a fresh
    run that saved none yet: the restart does what the first attempt did."""
    from pp_core.app.restarts import LAUNCH_ENV, resume_setting

    step = tmp_path / "ckpt" / "step_00000004"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (tmp_path / "ckpt" / "latest").write_text("step_00000004\n")
    spec = parse_spec(tiny_gpt_spec(checkpoint={"dir": str(tmp_path / "ckpt")}))
    saved = (step / ".metadata").stat().st_mtime
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_setting(spec) is False  # the first attempt: checkpoint.resume
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv(LAUNCH_ENV, repr(saved + 60))  # launched after that checkpoint
    assert resume_setting(spec) is False
    monkeypatch.setenv(LAUNCH_ENV, repr(saved - 60))  # this launch saved it
    assert resume_setting(spec) == str(step)
