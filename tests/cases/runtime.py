"""What the runtime tests run on every rank: build a pipeline, take a step, compare with the
unsplit model on this process (same weights, same microbatches), return the differences.

Functions here run inside :class:`pp_core.testing.DistPool` workers, so they are module-level and
return plain picklable values; the assertions happen in the test process.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from pp_core import PipelineConfig, build_pipeline
from tests.cases.compare import UNIT, grad_difference, reference_grads

WIDTH = 16
TORCH_ZB_CSV = (  # torch 2.13 ScheduleInterleavedZeroBubble, p=2 v=2 m=4, compute_only dump
    "0F0,0F1,2F0,,2F1,2I0,2W0,0F2,2I1,2W1,0F3,0I0,0W0,2F2,0I1,0W1,2F3,2I2,2W2,2I3,2W3,0I2,0W2,"
    "0I3,0W3\r\n"
    ",1F0,1F1,3F0,3I0,3F1,3I1,3W0,1F2,1I0,3W1,1F3,1I1,1W0,3F2,3I2,1W1,3F3,3I3,3W2,1I2,3W3,1I3,"
    "1W2,1W3\r\n")


def mlp(num_layers: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(num_layers)])


class InPlace(nn.Module):
    """A block that changes the tensor it receives in place first (``x.add_(1)`` / ``x.mul_(2)``):
    unsplit it gets an intermediate result (a linear's output, which autograd does not save)."""

    def __init__(self, op: str):
        super().__init__()
        self.op, self.linear = op, nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.linear(x.add_(1) if self.op == "add" else x.mul_(2))


def in_place(op: str, num_layers: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), *[InPlace(op) for _ in range(num_layers - 1)])


def gpt(num_layers: int):
    from pp_core_builtins.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=32, dim=16, num_layers=num_layers, num_heads=2, max_seq_len=16)


def mse(output, target):
    return ((output - target) ** 2).mean()


def batch(kind: str, batch_size: int, seed: int = 1, seq: int = 8):
    generator = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return (torch.randn(batch_size, WIDTH, generator=generator),
                torch.randn(batch_size, WIDTH, generator=generator))
    tokens = torch.randint(0, 32, (batch_size, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def reference(model, loss_fn, inputs, target, num_microbatches, scale, call=None):
    """Loss (mean of microbatch losses) and gradients of the unsplit model on one process."""
    call = call or (lambda m, x: m(x))
    size = target.shape[0] // num_microbatches
    total = 0.0
    xs = split(inputs, size)
    for x, y in zip(xs, target.split(size)):
        loss = loss_fn(call(model, x), y)
        (loss / num_microbatches if scale else loss).backward()
        total += loss.item()
    return total / num_microbatches


def split(inputs, size):
    if isinstance(inputs, torch.Tensor):
        return list(inputs.split(size))
    if isinstance(inputs, dict):
        parts = {k: v.split(size) for k, v in inputs.items()}
        return [{k: parts[k][i] for k in inputs} for i in range(len(next(iter(parts.values()))))]
    parts = [t.split(size) for t in inputs]
    return [tuple(p[i] for p in parts) for i in range(len(parts[0]))]


def compare(pipe, ref_model, loss, ref_loss) -> dict:
    """Largest loss and gradient differences, and the parameter names this rank covered."""
    grads = grad_difference(pipe.model_parts, reference_grads(ref_model), scale=UNIT,
                            none_is_zero=True)
    loss_err = None if loss is None else abs(float(loss) - ref_loss)
    return {"grad_err": grads.worst, "loss_err": loss_err, "names": grads.names,
            "missing": grads.missing, "stages": pipe.stage_indices}


def train_case(schedule, num_microbatches, scale, kind="mlp", csv_text=None, steps=1,
               layers=8, buffer_pool=False) -> dict:
    """One or more steps of ``schedule``; differences against the unsplit model. ``kind``:
    ``mlp``, ``gpt``, or ``in_place_add`` / ``in_place_mul`` (:func:`in_place`)."""
    model = mlp(layers) if kind == "mlp" else \
        in_place(kind.rsplit("_", 1)[1], layers) if kind.startswith("in_place") else gpt(layers)
    ref_model = copy.deepcopy(model)
    loss_fn = "cross_entropy" if kind == "gpt" else mse
    data = "mlp" if kind != "gpt" else "gpt"
    batch_size = 2 * num_microbatches
    csv_path = None
    if csv_text is not None:
        import torch.distributed as dist

        csv_path = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                f"pp_core_sched_{os.getpid()}_{dist.get_rank()}.csv")
        with open(csv_path, "w", newline="") as handle:
            handle.write(csv_text)
    config = PipelineConfig(pp_schedule=schedule, pp_schedule_csv=csv_path,
                            pp_batch_size=batch_size, pp_microbatch_size=2, loss_fn=loss_fn,
                            scale_grads_in_schedule=scale, pp_recv_buffer_pool=buffer_pool)
    pipe = build_pipeline(model, config)
    from pp_core.losses import resolve_loss

    fn = resolve_loss(loss_fn)
    for step in range(steps):
        inputs, target = batch(data, batch_size, seed=step + 1, seq=8 - step % 3)
        loss = pipe.step(inputs, target=target)
        ref_loss = reference(ref_model, fn, inputs, target, num_microbatches, scale)
    if csv_path:
        os.remove(csv_path)
    return compare(pipe, ref_model, loss, ref_loss)


def check(results: list, atol: float = 1e-6, num_params: int | None = None) -> None:
    """Assert the per-rank results of :func:`train_case` (run in the test process)."""
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 1, f"exactly one rank returns the loss, got {len(losses)}"
    assert losses[0] <= atol * 10, f"loss differs by {losses[0]}"
    for rank, result in enumerate(results):
        assert not result["missing"], f"rank {rank}: no gradient for {result['missing']}"
        assert result["grad_err"] <= atol, \
            f"rank {rank} (stages {result['stages']}): gradient differs by {result['grad_err']}"
    names = [n for r in results for n in r["names"]]
    assert len(names) == len(set(names)), "a parameter is held by two ranks"
    if num_params is not None:
        assert len(names) == num_params


# ------------------------------------------------ shared by the 2- and 4-rank schedule test modules
# (two modules, not one parametrised over the rank count, so that each keeps one pool of its size)

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "dfs", "zero_bubble", "zb_h2",
             "v_schedule", "v_half", "v_min", "dualpipe_v"]


def check_schedule_mlp(pool, schedule: str, num_microbatches: int, scale: bool) -> None:
    """One MLP step of ``schedule`` on every rank of ``pool``, checked against one process."""
    if schedule == "dualpipe_v" and num_microbatches < 2 * pool.world_size:
        pytest.skip("dualpipe_v needs num_microbatches >= 2 * num_ranks")
    check(pool.run(train_case, schedule, num_microbatches, scale), num_params=16)
