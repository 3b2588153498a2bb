"""What the activation-checkpointing / compile matrix runs on every rank (see
``test_parallel_matrix.py``): a tiny ``layers``-contract model, wrapped through
:mod:`pp_core.parallel`, stepped once, compared with the unsplit eager model on this process."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pp_core import PipelineConfig, build_pipeline
from pp_core.parallel import ParallelSettings, parallelize
from tests.cases.compare import RELATIVE, grad_difference, reference_grads

WIDTH = 8


class Gated(nn.Module):
    """A gated residual block that counts its forward calls (recomputes included)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x):
        if not torch.compiler.is_compiling():
            self.calls += 1
        value, gate = self.up(self.norm(x)).chunk(2, -1)
        return x + self.down(value * torch.sigmoid(gate))


class Tiny(nn.Module):
    def __init__(self, num_layers: int = 4):
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(Gated() for _ in range(num_layers))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        if self.proj is not None:
            x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def mse(output, target):
    return ((output - target) ** 2).mean()


def matrix_case(schedule: str, ac: str, compiled: str | None, pool: bool,
                num_microbatches: int = 4) -> dict:
    """One step with AC ``ac`` (none/full/selective) and ``compiled`` (None or a backend)."""
    torch.manual_seed(0)
    model = Tiny()
    reference = copy.deepcopy(model)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=2 * num_microbatches,
                            pp_microbatch_size=2, loss_fn=mse, pp_recv_buffer_pool=pool)
    pipe = build_pipeline(model, config)
    keys = [list(part.state_dict()) for part in pipe.model_parts]
    parallelize(pipe, None, ParallelSettings(
        activation_checkpointing=ac, compile={"backend": compiled} if compiled else None))
    assert keys == [list(part.state_dict()) for part in pipe.model_parts], "FQNs changed"
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(2 * num_microbatches, WIDTH, generator=g)
    target = torch.randn(2 * num_microbatches, WIDTH, generator=g)
    blocks = [b for part in pipe.model_parts for b in part.layers]
    loss = pipe.step(inputs, target=target)
    calls = [b.calls for b in blocks]
    total = 0.0
    for x, y in zip(inputs.split(2), target.split(2)):
        ref_loss = mse(reference(x), y)
        ref_loss.backward()
        total += ref_loss.item()
    grads = grad_difference(pipe.model_parts, reference_grads(reference), scale=RELATIVE)
    assert not grads.missing, f"no gradient for {grads.missing}"
    worst = grads.worst
    loss_err = None if loss is None else abs(float(loss) - total / num_microbatches) / \
        abs(total / num_microbatches)
    return {"grad_err": worst, "loss_err": loss_err, "calls": calls,
            "num_microbatches": num_microbatches}


def hf_case(schedule: str, ac: str, backend: str | None) -> dict:
    """A tiny tied-embedding Llama through the same helpers; worst |grad diff| vs unsplit."""
    from pp_core_builtins.transformers import causal_lm_loss
    from tests.cases.hf import batch, reference_step, tiny_model

    reference = tiny_model("llama", 4, tie_word_embeddings=True)
    model = copy.deepcopy(reference)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=8, pp_microbatch_size=2,
                            loss_fn=causal_lm_loss)
    pipe = build_pipeline(model, config)
    keys = [list(part.state_dict()) for part in pipe.model_parts]
    parallelize(pipe, None, ParallelSettings(
        activation_checkpointing=ac, compile={"backend": backend} if backend else None))
    assert keys == [list(part.state_dict()) for part in pipe.model_parts], "FQNs changed"
    inputs, labels = batch(8)
    loss = pipe.step(inputs, target=labels)
    expected, grads = reference_step(reference, inputs, labels, config.num_microbatches)
    worst = 0.0
    for part in pipe.model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            worst = max(worst, (param.grad - grads[name]).abs().max().item())
    return {"worst": worst, "loss_err": None if loss is None else abs(float(loss - expected))}
