"""Ranks built with different pipelines are refused at build, on every rank, naming what differs.

Under torchrun every node reads its own file: ranks with different microbatch sizes once ran a
first step with wrong gradients and then timed out, different batch sizes trained on wrong
losses. ``build_pipeline`` compares what every rank built across the process group (2 gloo ranks
here) before any pipeline traffic.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pp_core import PipelineConfig, build_pipeline

NUM_RANKS = 2


pytestmark = pytest.mark.ranks(NUM_RANKS, timeout=60)


def mse(output, target):
    return ((output - target) ** 2).mean()


class MSE:
    """A loss object: its repr holds its address, which differs between processes."""

    def __call__(self, output, target):
        return mse(output, target)


def build_and_step(differ: str):
    """Build with this rank's settings (one of them differs on rank 1) and take a step."""
    import torch.distributed as dist

    rank = dist.get_rank()
    other = rank == 1
    width = 6 if other and differ == "model" else 8
    settings = {"pp_batch_size": 8, "pp_microbatch_size": 2, "loss_fn": mse}
    if other and differ == "microbatch":
        settings["pp_microbatch_size"] = 4
    if other and differ == "batch":
        settings["pp_batch_size"] = 4
    if other and differ == "loss":
        settings["loss_fn"] = "cross_entropy"
    if differ == "loss object":
        settings["loss_fn"] = MSE()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    try:
        pipe = build_pipeline(model, PipelineConfig(**settings), timeout=5)
        pipe.step(torch.randn(settings["pp_batch_size"], width),
                  target=torch.randn(settings["pp_batch_size"], width))
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.parametrize("differ, expected", [
    ("microbatch", "pp_microbatch_size differs (rank 0: 2; rank 1: 4)"),
    ("batch", "pp_batch_size differs (rank 0: 8; rank 1: 4)"),
    ("loss", f"loss_fn differs (rank 0: {mse.__module__}:mse; rank 1: 'cross_entropy')"),
    ("model", "model parameters and buffers differs (rank 0: 8 tensors, 288 elements"),
])
def test_ranks_that_built_different_pipelines_are_refused_on_every_rank(pool, differ, expected):
    for rank, (name, message) in enumerate(pool.run(build_and_step, differ)):
        assert name == "ConfigError", (rank, name, message)
        assert "the ranks of this pipeline built different" in message
        assert expected in message, message
        assert "same pipeline file" in message


@pytest.mark.parametrize("differ", ["nothing", "loss object"])
def test_ranks_that_agree_build_and_train(pool, differ):
    assert pool.run(build_and_step, differ) == [("no error", "")] * NUM_RANKS


def test_config_error_names_no_field_that_agrees(pool):
    message = pool.run(build_and_step, "batch")[0][1]
    assert "pp_microbatch_size" not in message and "loss_fn" not in message


def build_after(delay_on_rank_1: float):
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(delay_on_rank_1)
    entered = time.time()
    torch.manual_seed(0)
    build_pipeline(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]),
                   PipelineConfig(pp_batch_size=8, pp_microbatch_size=2, loss_fn=mse))
    return entered, time.time()


def test_no_rank_leaves_build_before_every_rank_has_joined(pool):
    """A rank that refuses its first step destroys its process group; had it left the build
    before a peer had even joined the group, that peer's connection could fail or wait."""
    (_, left_0), (entered_1, _) = pool.run(build_after, 1.0)
    assert left_0 >= entered_1
