"""The executor's public seams. Observers see every action of a real two-rank step, in program
order, with the waits for peers inside the actions; a ``torch.profiler`` trace of a step holds
one ``PP:<action>`` record per executed action, with the stage's kernels inside it; an allocator
says by a capability (``reuses_buffers``), not by its class, whether receives may go early."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from pp_core import PipelineConfig, build_pipeline, hookimpl
from pp_core.runtime.observers import ActionObserver


class Recorder(ActionObserver):
    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def on_action_start(self, action):
        self.calls.append(("start", str(action)))

    def on_action_end(self, action):
        self.calls.append(("end", str(action)))

    def on_wait_start(self, action):
        self.calls.append(("wait_start", str(action)))

    def on_wait_end(self, action):
        self.calls.append(("wait_end", str(action)))


def _pipe(schedule: str):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=8, pp_microbatch_size=2,
                            loss_fn=lambda out, target: ((out - target) ** 2).mean())
    return build_pipeline(model, config)


def _program(pipe, training: bool = True) -> list[str]:
    executor = pipe._train if training else pipe._eval
    return [str(action) for action in executor.program.actions]


def observed_steps(schedule: str):
    """One training step and one evaluation with an observer, then one step without it."""
    pipe = _pipe(schedule)
    recorder = Recorder()
    pipe.add_action_observer(recorder)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.step(x, target=y)
    train_calls, recorder.calls = recorder.calls, []
    pipe.eval_step(x, target=y)
    eval_calls, recorder.calls = recorder.calls, []
    pipe.remove_action_observer(recorder)
    pipe.step(x, target=y)
    return train_calls, _program(pipe), eval_calls, _program(pipe, False), recorder.calls


def profiled_step(schedule: str):
    pipe = _pipe(schedule)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.step(x, target=y)  # warm-up outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.step(x, target=y)
    events = [e for e in prof.events() if e.name.startswith("PP:")]
    names = [e.name for e in events]
    forward_kernels = {child.name for e in events if "F" in e.name and "SEND" not in e.name
                       and "RECV" not in e.name for child in e.cpu_children}
    return names, _program(pipe), sorted(forward_kernels)


pytestmark = pytest.mark.ranks(2)


def _check_calls(calls: list[tuple[str, str]], program: list[str]) -> None:
    """Start and end of every action once, in program order; waits inside compute actions
    (between that action's start and end); the end-of-step wait for sends last."""
    assert [name for what, name in calls if what == "start"] == program
    assert [name for what, name in calls if what == "end"] == program
    current = None
    for what, name in calls:
        if what == "start":
            assert current is None
            current = name
        elif what == "end":
            assert current == name
            current = None
        else:  # a wait: inside the action it belongs to, or the final wait for sends
            assert name == (current if current is not None else "None")
            if current is not None:
                assert "SEND" not in name and "RECV" not in name
    assert calls[-2:] == [("wait_start", "None"), ("wait_end", "None")]


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "interleaved_1f1b"])
def test_observers_see_every_action_of_training_and_evaluation(pool, schedule):
    results = pool.run(observed_steps, schedule)
    for train_calls, program, eval_calls, eval_program, after_removal in results:
        _check_calls(train_calls, program)
        _check_calls(eval_calls, eval_program)
        assert after_removal == []
    # the last rank waits for activations inside a forward, the first for gradients in a backward
    assert any(what == "wait_start" and "F" in name for what, name in results[1][0])
    assert any(what == "wait_start" and "F" not in name for what, name in results[0][0])


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_a_profiler_trace_has_one_pp_record_per_executed_action(pool, schedule):
    for names, program, forward_kernels in pool.run(profiled_step, schedule):
        assert Counter(names) == Counter("PP:" + action for action in program)
        assert len(names) == len(program)
        assert "aten::linear" in forward_kernels  # the stage's ops sit inside its PP: record


def test_an_observer_added_between_steps_sees_the_next_step_of_a_local_pipeline():
    """A single-process pipeline (torch.distributed not initialised, one stage)."""
    pipe = _pipe("gpipe")
    recorder = Recorder()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.step(x, target=y)
    pipe.add_action_observer(recorder)
    pipe.step(x, target=y)
    _check_calls(recorder.calls, _program(pipe))


class Pooled:
    """An allocator that does not say whether it reuses buffers: it may (the safe default)."""

    def allocate(self, lifetime, metas):
        return [torch.empty(meta.shape, dtype=meta.dtype) for meta in metas]

    def release(self, lifetime):
        pass


class FreshTensors(Pooled):
    """A plugin's allocator of fresh tensors, which says so."""

    reuses_buffers = False


class AllocatorPlugin:
    def __init__(self, allocator):
        self.allocator = allocator

    @hookimpl
    def pp_make_recv_buffer_allocator(self, config, program, rank, device):
        return self.allocator


def early_receives(allocator_class):
    """Whether gloo's early receives ran with this allocator, and the losses of three steps."""
    from pp_core.plugin_manager import load_plugins

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=8, pp_microbatch_size=2,
                            loss_fn=lambda out, target: ((out - target) ** 2).mean())
    plugins = load_plugins(plugins=[AllocatorPlugin(allocator_class())],
                           disabled=["pp_buffer_pool"])
    pipe = build_pipeline(model, config, plugins=plugins)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    losses = [pipe.step(x, target=y) for _ in range(3)]  # shapes predicted from step 3 on
    # rank 1 posted its forward receives at the start of step 3 (predicted shapes)
    state = pipe._train.state  # the last step's
    early = state.early_receives, bool(state.preposted)
    return early, [None if loss is None else float(loss) for loss in losses]


def test_an_allocator_that_reuses_no_buffers_gets_early_receives_whatever_its_class(pool):
    fresh = pool.run(early_receives, FreshTensors)
    pooled = pool.run(early_receives, Pooled)
    assert [early for early, _ in fresh] == [(True, False), (True, True)]
    assert [early for early, _ in pooled] == [(False, False), (False, False)]
    assert [losses for _, losses in fresh] == [losses for _, losses in pooled]
