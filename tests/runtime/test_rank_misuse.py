"""Misuse across ranks is named at once instead of hanging (issue #25, class 6), over real gloo
ranks: a model wrapped by fully_shard before build_pipeline, ranks calling step and eval_step
at the same time, a meta-device model, a pp_pipeline_step wrapper that swallows the step's error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.cases.runtime import mse
from pp_core import PipelineConfig, build_pipeline, hookimpl

NUM_RANKS = 2


pytestmark = pytest.mark.ranks(NUM_RANKS, timeout=60)


def raising_loss(output, target):
    raise KeyError("the loss failed")


class Swallow:
    """A wrapper that hides the step's exception (what a careless plugin does)."""

    @hookimpl(wrapper=True)
    def pp_pipeline_step(self, pipeline, training):
        try:
            return (yield)
        except Exception:
            return None


def _model(device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def misuse(case: str):
    import torch.distributed as dist

    from pp_core.plugin_manager import load_plugins

    rank = dist.get_rank()
    config = PipelineConfig(pp_batch_size=4, pp_microbatch_size=2, loss_fn=mse)
    inputs, target = torch.randn(4, 8), torch.randn(4, 8)
    try:
        if case == "fully_shard first":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            model = _model()
            fully_shard(model, mesh=init_device_mesh("cpu", (NUM_RANKS,)))
            build_pipeline(model, config, timeout=5)
        elif case == "step vs eval_step":
            pipe = build_pipeline(_model(), config, timeout=5)
            pipe.step(inputs, target=target)
            if rank == 0:
                pipe.eval_step(inputs, target=target)
            else:
                pipe.step(inputs, target=target)
        elif case == "meta model":
            build_pipeline(_model("meta"), config, device="cpu", timeout=5)
        elif case == "swallowing wrapper":
            plugins = load_plugins(plugins=[("pp_swallow", Swallow())])  # the installed, and it
            pipe = build_pipeline(_model(), PipelineConfig(pp_batch_size=4, pp_microbatch_size=2,
                                                           loss_fn=raising_loss), timeout=5,
                                  plugins=plugins)
            pipe.step(inputs, target=target)
        elif case == "tpu":
            build_pipeline(_model(), config, device="tpu:7", timeout=5)
        else:
            pipe = build_pipeline(_model(), config, timeout=5)
            pipe.step(inputs, target=target)
            pipe.eval_step(inputs, target=target)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.parametrize("case, expected", [
    ("fully_shard first", "already wrapped for data parallelism: '<the model>' (fully_shard "
                          "(FSDP2))"),
    ("step vs eval_step", "rank 0 calls eval_step (its call 2); rank 1 calls step (its call 2)"),
    ("tpu", "device='tpu:7' is not a torch device"),
    ("meta model", "is on the meta device (no values; e.g. '0.weight')"),
])
def test_misuse_is_refused_on_every_rank(pool, case, expected):
    for name, message in pool.run(misuse, case):
        assert name == "ConfigError" and expected in message, message


def test_a_swallowed_step_error_is_raised_with_its_cause(pool):
    (name0, message0), (name1, message1) = pool.run(misuse, "swallowing wrapper")
    assert name1 == "PluginError", message1
    assert "pp_swallow" in message1 and "swallowed the step's exception" in message1
    assert "KeyError: 'the loss failed'" in message1  # the cause, not a transport error later


def test_ranks_that_agree_still_train(pool):
    assert pool.run(misuse, "fine") == [("no error", "")] * NUM_RANKS
