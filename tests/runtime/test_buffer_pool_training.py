"""Training with the receive-buffer pool is bit-identical to training without it (2 gloo ranks).

For every built-in schedule and a CSV schedule: the same seeds, the same batches, once with
``pp_recv_buffer_pool=False`` and once with ``True``; every step's loss and every parameter's
gradient must be *equal* (not close). Variants: activation checkpointing on every receiving stage
(``torch.utils.checkpoint`` recomputes from the saved received input during the backward), and a
sequence length that changes every step (the pool's sets grow and serve views). A deliberately
unsafe allocator (one buffer per class, reused at once) shows the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from pp_core_builtins.buffer_pool import RecvBufferPool
from pp_core import hookimpl
from tests.schedule.test_buffer_pool_sizing import CUSTOM_CSV

NUM_RANKS = 2
NUM_MICROBATCHES = 4
HIDDEN = 8
SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "dfs", "zero_bubble", "zb_h2",
             "v_schedule", "v_half", "v_min", "dualpipe_v"]


class Block(nn.Module):
    """Linear + tanh; the Linear saves its input (the received tensor) for the weight gradient."""

    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.checkpointed = checkpointed

    def _run(self, x):
        return torch.tanh(self.linear(x))

    def forward(self, x):
        if self.checkpointed:
            return checkpoint(self._run, x, use_reentrant=False)
        return self._run(x)


def make_model(num_stages: int, checkpointed: bool) -> nn.Sequential:
    torch.manual_seed(0)
    # Two blocks per stage; the first block of every stage but the first one reads a received
    # input, so that is where checkpointing recomputes from it.
    return nn.Sequential(*[Block(checkpointed and i % 2 == 0 and i > 0)
                           for i in range(2 * num_stages)])


def mse_sum(output, target):
    return ((output - target) ** 2).sum()


def batches(seq_lens):
    generator = torch.Generator().manual_seed(1)
    for seq_len in seq_lens:
        inputs = torch.randn(NUM_MICROBATCHES, seq_len, HIDDEN, generator=generator)
        target = torch.randn(NUM_MICROBATCHES, seq_len, HIDDEN, generator=generator)
        yield inputs, target


class UnsafeAllocator:
    """One buffer per receive class, handed out again at once: a broken pool, for contrast."""

    def __init__(self, program):
        self.classes = [(lt.action.stage, lt.action.kind) for lt in program.recv_lifetimes]
        self.buffers = {}

    def allocate(self, lifetime, metas):
        key = self.classes[lifetime]
        old = self.buffers.get(key)
        if old is None or [tuple(t.shape) for t in old] != [tuple(m.shape) for m in metas]:
            self.buffers[key] = old = [torch.empty(m.shape, dtype=m.dtype) for m in metas]
        return old

    def release(self, lifetime):
        pass


class PoolWithoutCopy(RecvBufferPool):
    """The real pool, slack 0, but ``consume`` frees the buffers without copying them out."""

    def consume(self, lifetime, tensors):
        self._free(lifetime)
        return list(tensors)


class UnsafePlugin:
    def __init__(self, kind: str):
        self.kind = kind

    @hookimpl
    def pp_make_recv_buffer_allocator(self, config, program, rank, device):
        if not config.pp_recv_buffer_pool:
            return None
        if self.kind == "ring":
            return UnsafeAllocator(program)
        return PoolWithoutCopy(program, device, slack=0)


def train(schedule: str, pool: bool, checkpointed: bool, seq_lens, csv_path=None,
          unsafe: str = ""):
    """Losses (last stage's rank) and gradients of this rank's parameters, step by step."""
    from pp_core import PipelineConfig
    from pp_core.plugin_manager import load_plugins
    from pp_core.runtime.build import build_pipeline

    stages_per_rank = 2 if schedule not in ("1f1b", "gpipe", "zero_bubble", "zb_h2") else 1
    num_stages = NUM_RANKS * stages_per_rank
    config = PipelineConfig(pp_schedule=schedule if csv_path is None else "1f1b",
                            pp_schedule_csv=csv_path, pp_batch_size=NUM_MICROBATCHES,
                            pp_microbatch_size=1, loss_fn=mse_sum, pp_recv_buffer_pool=pool)
    plugins = None
    if unsafe:
        plugins = load_plugins(plugins=[UnsafePlugin(unsafe)],
                               disabled=["pp_core_builtins.buffer_pool"])
    pipe = build_pipeline(make_model(num_stages, checkpointed), config, plugins=plugins)
    history = []
    for inputs, target in batches(seq_lens):
        for part in pipe.model_parts:
            part.zero_grad(set_to_none=True)
        loss = pipe.step(inputs, target=target)
        grads = {f"{index}.{name}": p.grad.clone()
                 for index, part in zip(pipe.stage_indices, pipe.model_parts)
                 for name, p in part.named_parameters()}
        history.append((None if loss is None else loss.clone(), grads))
    # Forward only (its own program, same allocator): the loss, and the outputs themselves.
    evaluated = [pipe.eval_step(inputs, target=target), pipe.eval_step(inputs)]
    history.append((evaluated, {}))
    report = pipe.allocator.report() if pool and not unsafe else None
    return history, report


def compare(schedules, checkpointed=False, seq_lens=(5,), csv_path=None, unsafe=""):
    """Run with and without the pool on this rank; the first difference found, or None."""
    found = []
    for schedule in schedules:
        plain, _ = train(schedule, False, checkpointed, seq_lens, csv_path)
        pooled, report = train(schedule, True, checkpointed, seq_lens, csv_path, unsafe)
        for step, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(zip(plain, pooled)):
            if not _equal(loss_a, loss_b):
                found.append(f"{schedule} step {step}: loss {loss_a} != {loss_b}")
            for name in grads_a:
                if not torch.equal(grads_a[name], grads_b[name]):
                    found.append(f"{schedule} step {step}: grad of {name} differs")
        if report is not None:
            overflow = [row for row in report if row["overflow"]]
            if overflow and not unsafe:
                found.append(f"{schedule}: more sets than planned {overflow}")
    return found, dist.get_rank()


def _equal(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    return torch.equal(a, b)


@pytest.fixture(scope="module")
def ranks(pools):
    return pools(NUM_RANKS)


def _differences(results):
    return [difference for found, _ in results for difference in found]


@pytest.mark.ranks
def test_every_schedule_trains_bit_identically_with_the_pool(ranks):
    assert _differences(ranks.run(compare, SCHEDULES, seq_lens=(5, 5))) == []


@pytest.mark.ranks
def test_activation_checkpointing_with_the_pool(ranks):
    assert _differences(ranks.run(compare, SCHEDULES, checkpointed=True)) == []


@pytest.mark.ranks
def test_variable_sequence_length_with_the_pool(ranks):
    assert _differences(ranks.run(compare, SCHEDULES, seq_lens=(3, 7, 2, 7))) == []


@pytest.mark.ranks
def test_csv_schedule_with_the_pool(ranks, tmp_path):
    path = tmp_path / "custom.csv"
    path.write_text(CUSTOM_CSV, newline="")
    results = ranks.run(compare, ["csv"], checkpointed=True, seq_lens=(3, 6), csv_path=str(path))
    assert _differences(results) == []


@pytest.mark.ranks
@pytest.mark.parametrize("unsafe,checkpointed", [("ring", False), ("no_copy", False),
                                                  ("no_copy", True)])
def test_reusing_a_buffer_while_its_message_is_in_use_is_caught(ranks, unsafe, checkpointed):
    """Controls: a ring that ignores lifetimes, and the pool minus its copy-out, both change the
    gradients - so the equalities above do test that the pool never aliases a live message."""
    results = ranks.run(compare, ["gpipe"], checkpointed=checkpointed, unsafe=unsafe)
    assert _differences(results), "the comparison cannot see a buffer overwritten while in use"
