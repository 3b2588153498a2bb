"""PP x DP training equals one process on the global batch, and dp gradients are reduced once per
step (not once per microbatch) - counted on the real collectives of a real 4-rank run."""

from __future__ import annotations

import collections
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from pp_core.checkpoint import latest_checkpoint, read_model_state_dict
from pp_core.parallel.gradients import finish_gradients
from pp_core.losses import cross_entropy
from pp_core.app.spec import parse_spec
from pp_core.app.spec.sections import TrainSpec
from pp_core.app.factories import dp_slice
from pp_core.app.rank import lr_factor
from pp_core.runtime.microbatch import num_tokens
from pp_core_builtins.models import GPT
from pp_core_builtins.models.datasets import SyntheticLM
from tests.cases.warm import warm_launch

MODEL = {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2, "max_seq_len": 8}
DATA = {"seq_len": 8, "vocab_size": 32, "seed": 3}
STEPS, PP_BATCH, DP = 3, 4, 2


def spec_values(tmp_path) -> dict:
    return {
        "model": {"name": "gpt", "args": MODEL},
        "data": {"name": "synthetic", "args": DATA},
        "pipeline": {"pp_schedule": "1f1b", "pp_batch_size": PP_BATCH, "pp_microbatch_size": 1,
                     "loss_fn": "cross_entropy"},
        "distributed": {"pp_size": 2, "dp_size": DP, "device": "cpu"},
        "train": {"steps": STEPS, "seed": 7, "warmup_steps": 1, "lr_decay": "cosine",
                  "grad_clip": 0.5, "optimizer": {"name": "AdamW", "lr": 0.01}},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "output": {"progress": "off", "summary": False},
    }


def counting_train(spec):
    """Train, counting every all_reduce by the ranks of the group it ran on (a spy: the real
    collective still runs)."""
    from pp_core.app.rank import train

    counts: dict[tuple, int] = {}
    real = dist.all_reduce

    def spy(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        counts[ranks] = counts.get(ranks, 0) + 1
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = spy
    try:
        result = train(spec)
    finally:
        dist.all_reduce = real
    return {"summary": result, "all_reduce_calls": counts}


def reference(steps: int):
    """One process, the unsplit model, the whole global batch as microbatches of one sample."""
    torch.manual_seed(7)
    model = GPT(**MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = iter(SyntheticLM(batch_size=PP_BATCH * DP, **DATA))
    train = parse_spec({"model": {"name": "gpt"}, "data": {"name": "synthetic"},
                        "train": {"steps": steps, "warmup_steps": 1, "lr_decay": "cosine"}}).train
    losses = []
    for step in range(1, steps + 1):
        inputs, target = next(data)
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * lr_factor(step, train)
        optimizer.zero_grad()
        total = 0.0
        for x, y in zip(inputs.split(1), target.split(1)):
            loss = cross_entropy(model(x), y)
            (loss / len(inputs)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        losses.append(total / len(inputs))
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def pp2_dp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp2dp2")
    results = warm_launch(parse_spec(spec_values(tmp), "pp2dp2.yaml"), counting_train)
    return tmp, results


@pytest.mark.ranks
def test_pp2_dp2_equals_one_process_on_the_global_batch(pp2_dp2):
    tmp, results = pp2_dp2
    losses = results[0]["summary"]["losses"]
    expected_losses, expected_state = reference(STEPS)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses),
                               rtol=1e-5, atol=1e-6)
    trained = read_model_state_dict(latest_checkpoint(tmp / "ckpt"))
    assert sorted(trained) == sorted(expected_state)
    for name, value in expected_state.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.ranks
def test_dp_gradients_are_reduced_once_per_step_not_per_microbatch(pp2_dp2):
    _, results = pp2_dp2
    assert sorted(results) == [0, 1, 2, 3]
    for rank, result in results.items():
        calls = result["all_reduce_calls"]
        # mesh (pp, dp_replicate, dp_shard) = (2, 2, 1): rank = pp * 2 + dp
        dp_group = tuple(sorted({rank // 2 * 2, rank // 2 * 2 + 1}))
        pp_group = tuple(sorted({rank % 2, rank % 2 + 2}))
        # dp_size: 2 is dp_replicate: torch's replicate, one all-reduce per unit (each of the
        # stage's 2 blocks, and the part's own embedding or norm/head) per step, while the
        # pipeline ran PP_BATCH = 4 microbatches per step on every rank
        assert result["summary"]["dp_units"] == 3
        # and on the last stage's ranks one more per step: cross_entropy's count of the step's
        # valid target tokens over the dp ranks (docs/data.md, the token-exact loss)
        counts = STEPS if rank // 2 == 1 else 0
        assert calls[dp_group] == STEPS * 3 + counts, calls
        assert calls[pp_group] == STEPS, calls  # the global gradient norm for clipping
        # the reported loss, and before the one checkpoint (save_final) whether every rank's
        # weights are finite (pp_core.app.rank.health: a save never writes NaN weights)
        assert calls[(0, 1, 2, 3)] == STEPS + 1, calls


def test_finish_gradients_scales_and_fills_missing():
    model = GPT(**MODEL)
    params = list(model.parameters())
    for param in params[1:]:
        param.grad = torch.ones_like(param)
    finish_gradients(params, 4)
    assert torch.all(params[0].grad == 0)
    assert all(torch.all(p.grad == 0.25) for p in params[1:])


def test_lr_schedule_and_batch_helpers():
    train = TrainSpec(warmup_steps=2, steps=10, lr_decay="cosine", min_lr_ratio=0.1)
    assert [lr_factor(s, train) for s in (1, 2)] == [0.5, 1.0]
    assert math.isclose(lr_factor(10, train), 0.1)
    assert lr_factor(5, replace(train, lr_decay="constant")) == 1.0
    assert math.isclose(lr_factor(6, replace(train, lr_decay="linear")), 1 - 0.9 * 0.5)
    batch = torch.arange(8).reshape(4, 2)
    assert dp_slice({"x": batch}, 1, 2, 4)["x"].tolist() == [[4, 5], [6, 7]]
    with pytest.raises(Exception, match=r"expected the global batch size"):
        dp_slice(batch, 0, 2, 8)
    assert num_tokens(batch) == 8 and num_tokens(torch.zeros(4, 3, 5)) == 12
    # one rule for the run's tokens/s and the runtime initializers: token ids count first
    assert num_tokens((torch.zeros(4, 3, 5), batch)) == 8
    # dp shares are cut as microbatches are: a namedtuple keeps its type, None passes through
    pair = collections.namedtuple("Pair", "ids mask")
    share = dp_slice(pair(batch, None), 1, 2, 4)
    assert type(share) is pair and share.ids.tolist() == [[4, 5], [6, 7]] and share.mask is None
