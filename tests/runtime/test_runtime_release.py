"""A deleted pipeline frees its model at once, without the cyclic garbage collector.

Users rebuild a pipeline after a failure (the documented recovery) and when they change its
configuration; if the old one sat in a reference cycle, its parameters, gradients and
activations would stay allocated until ``gc.collect()`` happens to run (on a GPU: gigabytes). So
every check here runs with the collector disabled: after ``del pipe`` (and dropping the
exception of a failed step), weak references to a part, a parameter and its gradient are dead.
2 gloo ranks, every built-in schedule; after a training step, an evaluation, a traced step, and a
failed step. Within a step, a stage's sent output goes when its gradient arrives, not at the
step's end (gloo cannot report a send complete until it is waited for).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.cases.runtime import SCHEDULES, mlp, mse
from pp_core import PipelineConfig, PipelineError, build_pipeline
from pp_core.runtime.observers import ActionObserver
from pp_core.schedule.ir import B, I, SEND_F

NUM_RANKS = 2
M = 4


pytestmark = pytest.mark.ranks(NUM_RANKS, timeout=120)


def loss_failing_on_microbatch_1(output, target):
    loss_failing_on_microbatch_1.calls += 1
    if loss_failing_on_microbatch_1.calls == 2:
        raise ValueError("boom in loss_fn")
    return mse(output, target)


def build_use_delete(schedule: str, fail: bool, **config_kw) -> list[str]:
    """Build, use (or fail a step), delete; the names of the objects still alive."""
    loss_failing_on_microbatch_1.calls = 0
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        config = PipelineConfig(pp_schedule=schedule, pp_batch_size=M, pp_microbatch_size=1,
                                loss_fn=loss_failing_on_microbatch_1 if fail else mse,
                                **config_kw)
        pipe = build_pipeline(mlp(8), config)
        inputs, target = torch.randn(M, 16), torch.randn(M, 16)
        if fail:
            try:
                pipe.step(inputs, target=target)
            except PipelineError:
                pass
            else:
                raise AssertionError("the step did not fail")
        else:
            pipe.tracing = True
            pipe.step(inputs, target=target)
            pipe.tracing = False
            pipe.step(inputs, target=target)
            pipe.eval_step(inputs, target=target)
        part = pipe.model_parts[0]
        param = next(part.parameters())
        refs = {"model part": weakref.ref(part), "parameter": weakref.ref(param),
                "pipeline": weakref.ref(pipe)}
        if param.grad is not None:
            refs["gradient"] = weakref.ref(param.grad)
        elif not fail:
            raise AssertionError("a trained parameter has no gradient")
        del pipe, part, param
        return [name for name, ref in refs.items() if ref() is not None]
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_deleted_pipeline_frees_its_model_without_the_collector(pool, schedule):
    assert pool.run(build_use_delete, schedule, False) == [[]] * NUM_RANKS


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_pipeline_deleted_after_a_failed_step_frees_its_model(pool, schedule):
    assert pool.run(build_use_delete, schedule, True) == [[]] * NUM_RANKS


def test_with_the_receive_buffer_pool_and_static_shapes(pool):
    assert pool.run(build_use_delete, "interleaved_1f1b", False, pp_recv_buffer_pool=True,
                    pp_seq_len=16) == [[]] * NUM_RANKS


class SentOutputsAfterBackward(ActionObserver):
    """At each action's start: the forward sends still holding their tensor although the
    backward of the same stage and microbatch has already run (it consumed their gradient)."""

    def __init__(self, executor):
        self.executor = executor
        self.backward_done: set = set()
        self.late: list[str] = []
        self.most_held = 0

    def on_action_start(self, action) -> None:
        actions = self.executor.program.actions
        held = {actions[origin] for _, tensor, _, origin in self.executor.mailbox.sends
                if tensor is not None}  # a message may be a header and its payload
        self.most_held = max(self.most_held, len(held))
        self.late += [str(a) for a in held
                      if a.kind is SEND_F and (a.stage, a.microbatch) in self.backward_done]

    def on_action_end(self, action) -> None:
        if action.kind in (B, I):
            self.backward_done.add((action.stage, action.microbatch))


def held_sends(schedule: str, microbatches: int):
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=microbatches,
                            pp_microbatch_size=1, loss_fn=mse)
    pipe = build_pipeline(mlp(8), config)
    watch = SentOutputsAfterBackward(pipe._train)
    pipe.add_action_observer(watch)
    inputs, target = torch.randn(microbatches, 16), torch.randn(microbatches, 16)
    pipe.step(inputs, target=target)
    return watch.late, watch.most_held


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_sent_output_is_dropped_once_its_gradient_arrived(pool, schedule):
    results = pool.run(held_sends, schedule, 8)
    assert [late for late, _ in results] == [[]] * NUM_RANKS
    if schedule == "1f1b":  # rank 0 holds its warm-up messages, not all 8 of the step
        assert results[0][1] <= 2, results
