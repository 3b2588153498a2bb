"""The run recorder keeps what the summary needs in space that does not grow with the run.

It once kept every action's time of every step (~8 KB per step per rank at 64 microbatches).
The figures of the summary's per-step series (step, loss, step time, tokens/s) are one entry per
step by design; everything else the recorder retains must stay the same size from step to step.
A real single-process pipeline (8 microbatches, 1F1B) runs the steps; items are counted, not
timed.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from pp_core import PipelineConfig, build_pipeline
from pp_core.app.rank import run_outputs
from pp_core.app.rank.run_outputs import TRACE_STEPS, RunRecorder
from pp_core.app.spec import parse_spec

PER_STEP_SERIES = ("steps", "losses", "step_times", "tokens_per_s")


def retained_items(recorder: RunRecorder) -> int:
    """Entries in every container the recorder holds, except the per-step series."""
    count = len(recorder.timer.records)
    for name, value in vars(recorder).items():
        if name in PER_STEP_SERIES:
            continue
        if isinstance(value, dict):
            count += len(value) + sum(len(v) for v in value.values() if hasattr(v, "__len__"))
        elif isinstance(value, (list, tuple, set)):
            count += len(value)
    return count


def test_retained_state_does_not_grow_with_steps():
    spec = parse_spec({"model": {"name": "gpt"}, "data": {"name": "text_bytes"},
                       "output": {"metrics": None, "trace": None, "schedule_image": None}})
    ctx = types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"),
                                meshes=types.SimpleNamespace(pp_rank=0, dp_rank=0, mesh=None))
    torch.manual_seed(0)
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=8, pp_microbatch_size=1,
                            loss_fn=lambda out, target: ((out - target) ** 2).mean())
    pipe = build_pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), config)
    recorder = RunRecorder(spec, ctx, pipe, num_params=40)
    inputs, target = torch.randn(8, 4), torch.randn(8, 4)
    counts = {}
    for step in range(1, TRACE_STEPS + 41):
        loss = recorder.timed_step(pipe, inputs, target)
        recorder.record_step(step, float(loss), 0.01, 32, None, 0.1, 0.0)
        if step in (TRACE_STEPS + 5, TRACE_STEPS + 40):
            counts[step] = retained_items(recorder)
    assert counts[TRACE_STEPS + 5] == counts[TRACE_STEPS + 40], counts
    pipe.eval_step(inputs, target=target)  # evaluations do not count as training actions
    assert recorder.timer.records == []
    assert all(len(getattr(recorder, name)) == TRACE_STEPS + 40 for name in PER_STEP_SERIES)
    figures = recorder._rank_figures(dp_units=0)
    assert set(figures["kind_times"]) == {"0F", "0B"}
    assert all(seconds > 0 for seconds in figures["kind_times"].values())
    assert 0.0 <= figures["bubble_measured"] <= 1.0 and figures["comm_share"] >= 0.0
    assert {step for *_, step in figures["events"]} == set(range(41, TRACE_STEPS + 41))


def test_a_failed_step_and_the_slow_steps_reach_the_log(caplog, monkeypatch):
    """The failure of a (single-process) step is logged as it is raised; a step 3x slower than
    the steady mean is counted by the recorder (fed figures, not timed), unless the machine had
    more runnable work than processors then, and the run logs them once."""
    import pytest

    from pp_core import PipelineError

    def broken_loss(out, target):
        raise ValueError("boom in loss_fn")

    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=2, pp_microbatch_size=1,
                            loss_fn=broken_loss)
    pipe = build_pipeline(nn.Sequential(nn.Linear(4, 4)), config)
    with caplog.at_level("WARNING"), pytest.raises(PipelineError, match="boom in loss_fn"):
        pipe.step(torch.randn(2, 4), target=torch.randn(2, 4))
    [failure] = [r for r in caplog.records if r.name == "pp_core.runtime.failures"]
    assert failure.levelname == "ERROR" and "ValueError: boom in loss_fn" in failure.getMessage()

    spec = parse_spec({"model": {"name": "gpt"}, "data": {"name": "text_bytes"},
                       "output": {"metrics": None, "trace": None, "schedule_image": None}})
    ctx = types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"),
                                meshes=types.SimpleNamespace(pp_rank=0, dp_rank=0, mesh=None))
    recorder = RunRecorder(spec, ctx, pipe, num_params=20)
    for _ in range(3):
        recorder.steady_totals.add(0.1, 0.05, 0.01)
    caplog.clear()
    with caplog.at_level("WARNING", logger="pp_core.app.rank.run_outputs"):
        monkeypatch.setattr(run_outputs, "machine_busy", lambda: False)
        recorder._check_pace(5, 0.25)  # 2.5x: not slow
        recorder._check_pace(6, 0.5)
        recorder._check_pace(7, 0.4)
        monkeypatch.setattr(run_outputs, "machine_busy", lambda: True)
        recorder._check_pace(8, 0.9)  # slow while others' work filled the machine: noise
        assert not caplog.records  # counted, not logged step by step
        figures = {"rank": 1, "slow_steps": (len(recorder.slow_steps),
                                             max(recorder.slow_steps, key=lambda s: s[2]))}
        run_outputs._slow_warning([{"rank": 0, "slow_steps": (0, None)}, figures], 10)
    [slow] = caplog.records  # once for the run, with the count
    assert slow.getMessage() == (
        "2 step(s) took over 3x the mean of the steps before them (on rank(s) 1); the slowest, "
        "step 16 on rank 1, took 0.500 s, 5.0x: a straggling peer, a swapping host or a "
        "recompilation (output.trace shows the last steps)")
