"""Failures end every rank with a message, never a hang (3 gloo ranks, 1F1B).

A failure on rank 2 reaches rank 0 through rank 1 (rank 0 never talks to rank 2): every rank
raises ``PipelineError``; the failing rank names its rank, stage, action and cause, the others
say they stopped because another rank failed and quote that cause. Misuse is refused before any
traffic with a message saying what to change.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from pp_core import ConfigError, PipelineConfig, build_pipeline

NUM_RANKS = 3
M = 4


class Fault(nn.Module):
    """Identity, unless this rank and microbatch are the ones told to fail (and how)."""

    def __init__(self, rank, how, microbatch=1):
        super().__init__()
        self.rank, self.how, self.microbatch, self.calls = rank, how, microbatch, 0

    def forward(self, x):
        import torch.distributed as dist

        call, self.calls = self.calls, self.calls + 1
        if dist.get_rank() != self.rank or call != self.microbatch:
            return x
        if self.how == "raise":
            raise ValueError("boom in the model")
        if self.how == "sleep":
            time.sleep(4)
        if self.how == "exit":
            os._exit(3)
        if self.how == "dict":
            return {"hidden": x}
        return x


def model(rank=-1, how=None, width=8):
    torch.manual_seed(0)
    layers = []
    for _ in range(NUM_RANKS):
        layers += [nn.Linear(width, width), Fault(rank, how)]
    return nn.Sequential(*layers)


def mse(output, target):
    return ((output - target) ** 2).mean()


def loss_raising_on_microbatch_1(output, target):
    loss_raising_on_microbatch_1.calls = getattr(loss_raising_on_microbatch_1, "calls", 0) + 1
    if loss_raising_on_microbatch_1.calls == 2:
        raise ValueError("boom in loss_fn")
    return mse(output, target)


def run_step(net=None, loss_fn=mse, batch=2 * M, target=True, timeout=None, steps=1,
             config_kw=None):
    net = net if net is not None else model()
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=2 * M, pp_microbatch_size=2,
                            loss_fn=loss_fn, **(config_kw or {}))
    pipe = build_pipeline(net, config, timeout=timeout)
    for _ in range(steps):
        pipe.step(torch.randn(batch, 8), target=torch.randn(batch, 8) if target else None)
    return "finished"


def failing(how, where=2, **kw):
    """Run a failing step; then show that the pipeline refuses to continue."""
    import torch.distributed as dist

    rank = dist.get_rank()
    loss_raising_on_microbatch_1.calls = 0
    start = time.monotonic()
    try:
        run_step(**kw) if how is None else run_step(model(where, how), **kw)
    except Exception as exc:
        return type(exc).__name__, str(exc), round(time.monotonic() - start, 2), rank
    return "no error", "", round(time.monotonic() - start, 2), rank


pytestmark = pytest.mark.ranks(NUM_RANKS, timeout=60)


def _all_failed(outcomes, origin_rank, origin_text, kind="PipelineError"):
    results = [o.value for o in outcomes]
    assert all(o.ok for o in outcomes), [o.traceback for o in outcomes if not o.ok]
    for name, message, elapsed, rank in results:
        assert name == kind, (rank, name, message)
        assert origin_text in message, (rank, message)
        assert elapsed < 20, f"rank {rank} needed {elapsed} s to stop"
        if rank != origin_rank:
            assert f"rank {rank} stopped" in message and "because another rank failed" in message
        else:
            assert message.startswith(f"rank {rank}, stage ") or "refused" in message
    return {rank: message for _, message, _, rank in results}


def test_loss_fn_raising_on_the_last_rank_ends_every_rank(pool):
    messages = _all_failed(pool.run_outcomes(failing, None, loss_fn=loss_raising_on_microbatch_1),
                           2, "rank 2, stage 2, action 2F1: ValueError: boom in loss_fn")
    assert "at action 0" in messages[0] and "at action 1" in messages[1]


def test_model_raising_on_a_rank_ends_every_rank(pool):
    _all_failed(pool.run_outcomes(failing, "raise"), 2,
                "rank 2, stage 2, action 2F1: ValueError: boom in the model")


def test_shape_mismatch_names_rank_stage_and_action(pool):
    net = model()
    net[2] = nn.Linear(5, 8)  # stage 1 expects 5 features, stage 0 sends 8
    outcomes = pool.run_outcomes(failing, None, net=net)
    _all_failed(outcomes, 1, "rank 1, stage 1, action 1F0: RuntimeError: ")
    # torch's own words; 2.15 prefixes them with the op ("addmm: mat1 and mat2 ...")
    assert all("mat1 and mat2 shapes cannot be multiplied" in o.value[1] for o in outcomes)


class BrokenInitializer:
    resource_key = "workspace"
    signature = 1

    def prepare(self, num_tokens, device):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise RuntimeError("plugin cannot allocate its workspace")


class WithInitializer(nn.Linear):
    def pipeline_runtime_initializers(self):
        return [BrokenInitializer()]


def test_initializer_error_ends_every_rank(pool):
    torch.manual_seed(0)
    net = nn.Sequential(*[WithInitializer(8, 8) for _ in range(NUM_RANKS)])
    _all_failed(pool.run_outcomes(failing, None, net=net), 1,
                "rank 1, stage 1, action 1F0: RuntimeError: plugin cannot allocate its workspace")


def test_non_tensor_stage_output_is_explained(pool):
    _all_failed(pool.run_outcomes(failing, "dict", where=1), 1,
                "rank 1, stage 1, action 1F1: PipelineError: stage 1 returned dict; a stage that "
                "is not the last must return a tensor or a tuple of tensors")


def test_a_silent_peer_is_reported_after_the_timeout(pool):
    """Rank 1 stalls 4 s; rank 0 waits at most 1 s, stops, and its exit releases the others."""
    outcomes = pool.run_outcomes(failing, "sleep", where=1, timeout=1.0)
    results = {o.value[3]: o.value for o in outcomes}
    assert all(name == "PipelineError" for name, *_ in results.values()), results
    assert any("waited longer than 1 s for rank 1" in message
               for _, message, *_ in results.values()), results
    assert all(elapsed < 10 for _, _, elapsed, _ in results.values())


def test_a_dead_peer_ends_the_others(pool):
    outcomes = pool.run_outcomes(failing, "exit")
    assert not outcomes[2].ok  # the process itself is gone
    for rank in (0, 1):
        name, message, elapsed, _ = outcomes[rank].value
        assert name == "PipelineError" and "lost its connection to rank 2" in message, message
        assert elapsed < 20


def test_static_shapes_change_within_a_step_is_refused(pool):
    """pp_seq_len is a hint across steps (tests/nemo/test_nemo_pipeline.py), but the microbatches of
    one step must share their shapes while it is set: a stage that trims differently per
    microbatch fails on every rank, never hangs."""
    outcomes = pool.run_outcomes(static_shape_change)
    _all_failed(outcomes, 0, "with pp_seq_len set every microbatch of a step must have the same "
                             "shapes")


def square_loss(output, target):
    return output.square().mean()


class TrimByData(nn.Module):
    def forward(self, x):
        return x[:, :3] if x[0, 0, 0] > 0 else x[:, :2]


def static_shape_change():
    import torch.distributed as dist

    rank = dist.get_rank()
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=2 * M, pp_microbatch_size=2,
                            loss_fn=square_loss, pp_seq_len=4)
    torch.manual_seed(0)
    pipe = build_pipeline(nn.Sequential(nn.Sequential(TrimByData(), nn.Linear(8, 8)),
                                        *[nn.Linear(8, 8) for _ in range(NUM_RANKS - 1)]), config)
    x = torch.randn(2 * M, 4, 8)
    x[0, 0, 0], x[2, 0, 0] = 1.0, -1.0  # microbatch 0 keeps 3 positions, microbatch 1 keeps 2
    start = time.monotonic()
    try:
        pipe.step(x, target=x)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start, rank
    return "no error", "", 0, rank


def test_pipeline_refuses_to_continue_after_a_failure(pool):
    assert all(pool.run(step_after_failure))


def step_after_failure():
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=2 * M, pp_microbatch_size=2,
                            loss_fn=loss_raising_on_microbatch_1)
    loss_raising_on_microbatch_1.calls = 0
    pipe = build_pipeline(model(), config)
    x, y = torch.randn(2 * M, 8), torch.randn(2 * M, 8)
    with pytest.raises(Exception):
        pipe.step(x, target=y)
    with pytest.raises(Exception, match="stopped after a failure"):
        pipe.step(x, target=y)
    return True


# ---------------------------------------------------------------------------- misuse


def test_wrong_batch_size_is_refused_on_every_rank_before_traffic(pool):
    outcomes = pool.run_outcomes(failing, None, batch=2 * M + 2)
    for o in outcomes:
        name, message, elapsed, rank = o.value
        assert name == "ConfigError", message
        assert "batch size 10" in message and "pp_batch_size=8" in message


def test_missing_target_is_refused(pool):
    outcomes = pool.run_outcomes(failing, None, target=False)
    values = {o.value[3]: o.value for o in outcomes}
    assert values[2][0] == "ConfigError"
    assert "needs a target, but step() got target=None" in values[2][1]
    for rank in (0, 1):
        assert values[rank][0] == "PipelineError" and "refused the step" in values[rank][1], values


def test_missing_loss_fn_is_refused(pool):
    outcomes = pool.run_outcomes(failing, None, loss_fn=None)
    for o in outcomes:
        assert o.value[0] == "ConfigError" and "set PipelineConfig.loss_fn" in o.value[1]


def unsplittable():
    class Opaque(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.weight

    config = PipelineConfig(pp_batch_size=2 * M, pp_microbatch_size=2, loss_fn=mse)
    try:
        build_pipeline(Opaque(), config)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def test_model_the_splitter_cannot_split_is_refused_at_build(pool):
    for name, message in pool.run(unsplittable):
        assert name in ("ConfigError", "PluginError"), message
        assert "Opaque" in message


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
