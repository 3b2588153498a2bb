"""Sequence slices (``pp_seq_chunks``) composed with the receive-buffer pool, tensor
parallelism, LoRA (PEFT) and ``torch.compile``: K = 2 and 4 give K = 1's losses and gradients
(fp32, 1e-5).

The pool and tp need ranks: one call on the 4 gloo ranks the other slices tests share (two
pipelines of 2 ranks with the pool on; then the same ranks as pp 2 x tp 2). LoRA and compile run
in this process, both stages of ``v_schedule`` on it (so a slice's keys and values stay on a
stage across ranks' worth of units, and a split backward runs).
"""

from __future__ import annotations

import copy

import pytest
import torch

from pp_core import PipelineConfig, build_pipeline

from tests.runtime.test_seq_slices_local import _packed_gpt


def _differences(runs: dict) -> dict:
    """``{K: (worst loss difference, worst gradient difference)}`` against ``runs[1]``; a
    DTensor gradient is compared whole (``full_tensor``)."""

    def whole(grad):
        return grad.full_tensor() if hasattr(grad, "full_tensor") else grad

    base_losses, base_grads = runs[1]
    out = {}
    for k, (losses, grads) in runs.items():
        if k == 1:
            continue
        out[k] = (max((abs(a - b) for a, b in zip(losses, base_losses) if a is not None),
                      default=0.0),
                  max(float((whole(grads[n]) - whole(base_grads[n])).abs().max())
                      for n in base_grads))
    return out


def _train(pipe, inputs, target, steps: int = 2):
    """``steps`` SGD steps; ``(losses, final gradients by name)``."""
    params = [p for part in pipe.model_parts for p in part.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.5)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = pipe.step(inputs, target=target)
        losses.append(None if loss is None else float(loss))
        optimizer.step()
    return losses, {name: p.grad.detach().clone() for part in pipe.model_parts
                    for name, p in part.named_parameters() if p.grad is not None}


def pool_and_tp_case(chunks=(2, 4)) -> tuple:
    """On each of 4 ranks: K = 1 and ``chunks`` with the receive-buffer pool (pp 2, 1F1B; ZB-H1
    the largest K only; two pipelines side by side), then pp 2 x tp 2 (1F1B, the built-in GPT
    plan, the largest K).
    ``(differences by case, the pool's (overflow, reused) per receive class by (schedule, K))``."""
    import torch.distributed as dist

    from pp_core.parallel import apply_tensor_parallel
    from tests.cases.tp import pp_tp_mesh
    from tests.runtime.test_seq_slices_runtime import _batch

    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    from pp_core_builtins.models.gpt import GPT

    model = GPT(vocab_size=64, dim=32, num_layers=4, num_heads=2, max_seq_len=32)
    inputs, target = _batch(4, 16)
    found, reused = {}, {}
    pp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    for schedule, tried in (("1f1b", chunks), ("zero_bubble", chunks[-1:])):
        runs = {}
        for k in (1, *tried):
            config = PipelineConfig(pp_schedule=schedule, pp_batch_size=4, pp_microbatch_size=1,
                                    loss_fn="cross_entropy", pp_seq_chunks=k,
                                    pp_recv_buffer_pool=True, pp_seq_len=16)
            pipe = build_pipeline(copy.deepcopy(model), config, pp_group=pp)
            runs[k] = _train(pipe, inputs, target)
            reused[(schedule, k)] = [(row["overflow"], row["pool_sets"] < row["default_sets"])
                                     for row in pipe.allocator.report()]
        found[f"pool-{schedule}"] = _differences(runs)
    mesh = pp_tp_mesh()
    runs = {}
    for k in (1, chunks[-1]):
        config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=4, pp_microbatch_size=1,
                                loss_fn="cross_entropy", pp_seq_chunks=k)
        pipe = build_pipeline(copy.deepcopy(model), config, pp_group=mesh["pp"])
        assert apply_tensor_parallel(pipe.model_parts, mesh["tp"])  # the blocks it sharded
        runs[k] = _train(pipe, inputs, target)
    found["tp"] = _differences(runs)
    return found, reused


@pytest.mark.ranks(4)
def test_slices_with_the_buffer_pool_and_tensor_parallelism(pools):
    for rank, (result, reused) in enumerate(pools(4).run(pool_and_tp_case)):
        for (schedule, k), rows in reused.items():  # the pool served slices, reusing its sets
            assert rows and all(row == (0, True) for row in rows), (rank, schedule, k, rows)
        for case, by_k in result.items():
            for k, (loss_diff, grad_diff) in by_k.items():
                assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (rank, case, k, by_k)


def _one_process(model, inputs, ids, prepare=lambda parts: None, chunks=(1, 4)) -> dict:
    """K = 1 and ``chunks``' differences; ``prepare`` applies to the sliced runs only (so a
    compiled K = 4 is held to the eager K = 1)."""
    runs = {}
    for k in chunks:
        pipe = build_pipeline(copy.deepcopy(model), PipelineConfig(
            pp_schedule="v_schedule", pp_batch_size=4, pp_microbatch_size=1,
            loss_fn="cross_entropy", pp_seq_chunks=k))
        if k > 1:
            prepare(pipe.model_parts)
        runs[k] = _train(pipe, inputs, ids)
    return _differences(runs)


def test_slices_with_lora_adapters_equal_the_unsliced_step():
    """PEFT LoRA on every linear layer (random B, so every adapter gradient is non-zero): the
    adapters' gradients and the losses of two steps equal K = 1."""
    pytest.importorskip("peft")
    from pp_core.app.adapters import apply_adapters

    model, ids, inputs = _packed_gpt(num_layers=2)
    torch.manual_seed(1)
    model = apply_adapters(model, {"r": 4, "alpha": 8, "init_lora_weights": False}, None)
    for k, (loss_diff, grad_diff) in _one_process(model, inputs, ids).items():
        assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (k, loss_diff, grad_diff)


def test_slices_with_compiled_blocks_equal_the_unsliced_step():
    """``apply_compile`` (the ``aot_eager`` backend: the same autograd node as inductor without
    the C++ compile): each block compiled, the prefix's attention inside it; K = 4 compiled
    against K = 1 eager."""
    from pp_core.parallel.compile import apply_compile

    model, ids, inputs = _packed_gpt(num_layers=2)

    def compile_blocks(parts):
        assert apply_compile(parts, backend="aot_eager") == ["layers.0", "layers.1"]

    for k, (loss_diff, grad_diff) in _one_process(model, inputs, ids, compile_blocks).items():
        assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (k, loss_diff, grad_diff)


def test_slices_with_checkpointed_hf_layers_equal_the_unsliced_step():
    """A tiny HF Llama (grouped-query attention) with every decoder layer checkpointed, full and
    selective: the recompute re-enters the slice and its SDPA routing (``SeqSlice.routing``), so
    it saves what the forward saved (the prefix attention's pieces), and K = 2 equals K = 1."""
    pytest.importorskip("transformers")
    from pp_core.parallel.activation import apply_activation_checkpointing
    from pp_core_builtins.transformers import causal_lm_loss, hf_causal_lm
    from tests.cases.hf import batch, tiny_config

    model = hf_causal_lm(tiny_config("llama", 2), seed=0, attn_implementation="sdpa")
    inputs, labels = batch(4, padding=False)
    for mode in ("full", "selective"):
        runs = {}
        for k in (1, 2):
            pipe = build_pipeline(copy.deepcopy(model), PipelineConfig(
                pp_schedule="gpipe", pp_batch_size=4, pp_microbatch_size=2, pp_seq_chunks=k,
                loss_fn=causal_lm_loss))
            assert apply_activation_checkpointing(pipe.model_parts, mode)
            runs[k] = _train(pipe, inputs, labels, steps=1)
        for k, (loss_diff, grad_diff) in _differences(runs).items():
            assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (mode, k, loss_diff, grad_diff)
