"""Sequence slices (``pp_seq_chunks``) on real ranks: K = 2 and 4 equal K = 1 exactly.

One pool of 4 gloo ranks for every case: two pipelines of 2 ranks (``pp2``), or the same four
ranks as pp 2 x dp 2 (the token count of the loss summed over the dp ranks). Each case trains the
demo GPT on packed rows (documents cross the slice boundaries, position ids restart, a masked
target) two steps with K = 1, 2, 4 and compares every step's loss and every final gradient
(fp32, 1e-5).
"""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.ranks(4)


def _batch(batch: int, seq: int):
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (batch, seq), generator=gen)
    target = torch.randint(0, 64, (batch, seq), generator=gen)
    target[0, 5] = target[3, 0] = -100
    # documents of 5, 7 and 4 tokens: they end inside slices of 4 and 8 tokens
    positions = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)]).repeat(batch, 1)
    return {"input_ids": ids, "position_ids": positions}, target


def slices_case(schedule: str, use_dp: bool, chunks=(2, 4)):
    import torch
    import torch.distributed as dist

    from pp_core import PipelineConfig, build_pipeline
    from pp_core_builtins.models.gpt import GPT

    from tests.cases.fsdp import pp_dp_meshes

    rank = dist.get_rank()
    run_meshes = pp_dp_meshes() if use_dp else None  # pp outermost: dp rank = rank % 2
    pp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    torch.manual_seed(0)
    model = GPT(vocab_size=64, dim=32, num_layers=4, num_heads=2, max_seq_len=32)
    inputs, target = _batch(8, 16)
    if use_dp:  # this dp rank's half of the global batch
        share = slice(4 * run_meshes.dp_rank, 4 * (run_meshes.dp_rank + 1))
        inputs, target = {k: v[share] for k, v in inputs.items()}, target[share]
    else:
        inputs, target = {k: v[:4] for k, v in inputs.items()}, target[:4]
    runs = {}
    for k in (1, *chunks):
        config = PipelineConfig(pp_schedule=schedule, pp_batch_size=4, pp_microbatch_size=1,
                                loss_fn="cross_entropy", pp_seq_chunks=k)
        pipe = build_pipeline(copy.deepcopy(model), config, meshes=run_meshes) if use_dp \
            else build_pipeline(copy.deepcopy(model), config, pp_group=pp)
        optimizer = torch.optim.SGD([p for part in pipe.model_parts for p in part.parameters()],
                                    lr=0.5)
        losses = []
        for _ in range(2):
            optimizer.zero_grad()
            loss = pipe.step(inputs, target=target)
            losses.append(None if loss is None else float(loss))
            optimizer.step()
        runs[k] = losses, {name: p.grad.clone() for part in pipe.model_parts
                           for name, p in part.named_parameters()}
    base_losses, base_grads = runs[1]
    out = {}
    for k in chunks:
        losses, grads = runs[k]
        out[k] = (max((abs(a - b) for a, b in zip(losses, base_losses) if a is not None),
                      default=0.0),
                  max(float((grads[n] - base_grads[n]).abs().max()) for n in base_grads),
                  base_losses)
    return out


@pytest.mark.parametrize("schedule, use_dp", [
    ("1f1b", False), ("zero_bubble", False), ("interleaved_1f1b", False), ("v_schedule", False),
    ("1f1b", True), ("zero_bubble", True)],
    ids=["1f1b-pp2", "zb-h1-pp2", "interleaved-pp2", "v-pp2", "1f1b-pp2xdp2", "zb-h1-pp2xdp2"])
def test_slices_equal_the_unsliced_run(pool, schedule, use_dp):
    trained = []
    for rank, result in enumerate(pool.run(slices_case, schedule, use_dp)):
        for k, (loss_diff, grad_diff, losses) in result.items():
            assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (rank, k, loss_diff, grad_diff)
            if losses[0] is not None:  # the last stage's rank: a real loss, which trains
                trained.append(losses[1] < losses[0])
    assert trained and all(trained)
