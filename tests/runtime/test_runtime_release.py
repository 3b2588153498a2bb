"""A deleted pipeline frees its model at once, without the cyclic garbage collector.

Users rebuild a pipeline after a failure (the documented recovery) and when they change its
configuration; if the old one sat in a reference cycle, its parameters, gradients and
activations would stay allocated until ``gc.collect()`` happens to run (on a GPU: gigabytes). So
every check here runs with the collector disabled: after ``del pipe`` (and dropping the
exception of a failed step), weak references to a part, a parameter and its gradient are dead.
2 gloo ranks, every built-in schedule; after a training step, an evaluation, a traced step, and a
failed step.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.cases.runtime import SCHEDULES, mlp, mse
from pp_core import PipelineConfig, PipelineError, build_pipeline

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
