"""What the token-exact loss tests run on every rank (DistPool workers): microbatches with very
different numbers of masked targets; the pipelined step's loss and gradients against the unsplit
model's loss over the *whole* batch (one forward, one mean over its valid targets) - not the mean
of microbatch means, which differs here by far more than the tolerance.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as functional

from pp_core import PipelineConfig, build_pipeline
from pp_core.losses import cross_entropy
from tests.cases.compare import UNIT, grad_difference, reference_grads
from tests.cases.runtime import gpt

VOCAB, SEQ = 32, 8
VALID_PER_ROW = (1, SEQ, SEQ // 2, 2)  # valid targets per row, by microbatch (cycled)


def masked_batch(batch_size: int, num_microbatches: int, seed: int = 1, shift: int = 0):
    """``(tokens, target)``: microbatch ``m``'s rows keep ``VALID_PER_ROW[m + shift]`` targets
    (the last ones), the others are ``-100``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
    inputs, target = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    rows = batch_size // num_microbatches
    for row in range(batch_size):
        keep = VALID_PER_ROW[(row // rows + shift) % len(VALID_PER_ROW)]
        target[row, : SEQ - keep] = -100
    return inputs, target


def plain_cross_entropy(output, target):
    """A two-argument loss: today's contract (mean per microbatch), not token-normalised."""
    return functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def even_tokens_loss(output, target, *, num_valid_tokens):
    """A user loss that opts in, counting only even target ids (odd ones are ignored)."""
    flat = target.reshape(-1)
    weights = ((flat % 2 == 0) & (flat != -100)).float()
    per_token = functional.cross_entropy(output.reshape(-1, output.shape[-1]),
                                         flat.clamp_min(0), reduction="none")
    return (per_token * weights).sum() / num_valid_tokens


even_tokens_loss.count_valid_tokens = lambda target: ((target % 2 == 0) & (target != -100)).sum()


def even_tokens_reference(output, target):
    flat = target.reshape(-1)
    weights = ((flat % 2 == 0) & (flat != -100)).float()
    per_token = functional.cross_entropy(output.reshape(-1, output.shape[-1]),
                                         flat.clamp_min(0), reduction="none")
    return (per_token * weights).sum() / weights.sum()


LOSSES = {"cross_entropy": ("cross_entropy", cross_entropy),
          "user": (even_tokens_loss, even_tokens_reference),
          "plain": (plain_cross_entropy, None)}


def _grad_errors(pipe, ref_model, factor: float) -> tuple[float, list]:
    grads = grad_difference(pipe.model_parts, reference_grads(ref_model), scale=UNIT,
                            factor=factor, prefix="module.")
    assert not grads.missing, f"no gradient for {grads.missing}"
    return grads.worst, grads.names


def token_case(schedule: str, loss: str = "cross_entropy", scale: bool = True,
               num_microbatches: int = 4, pool: bool = False) -> dict:
    """One step of the demo GPT on 2 ranks; loss and gradients vs the unsplit model."""
    model = gpt(4)
    ref_model = copy.deepcopy(model)
    loss_fn, ref_loss_fn = LOSSES[loss]
    batch_size = 2 * num_microbatches
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=batch_size, pp_microbatch_size=2,
                            loss_fn=loss_fn, scale_grads_in_schedule=scale,
                            pp_recv_buffer_pool=pool, pp_seq_len=SEQ if pool else None)
    pipe = build_pipeline(model, config)
    inputs, target = masked_batch(batch_size, num_microbatches)
    result = pipe.step(inputs, target=target)
    output = ref_model(inputs)
    if ref_loss_fn is None:  # the mean of microbatch means, as before
        parts = [plain_cross_entropy(o, t) for o, t in
                 zip(output.chunk(num_microbatches), target.chunk(num_microbatches))]
        ref_loss = torch.stack(parts).sum()
        ref_loss.backward()
        ref_loss = ref_loss.detach() / num_microbatches
        factor = 1.0 / num_microbatches if scale else 1.0
    else:  # the whole batch's loss: one mean over every valid target
        ref_loss = ref_loss_fn(output, target)
        ref_loss.backward()
        ref_loss = ref_loss.detach()
        factor = 1.0 if scale else float(num_microbatches)
    grad_err, names = _grad_errors(pipe, ref_model, factor)
    # how far the mean of microbatch means is from it: the comparison must be able to fail
    exact = {name: p.grad.clone() for name, p in ref_model.named_parameters()}
    ref_model.zero_grad(set_to_none=True)
    torch.stack([plain_cross_entropy(o, t) for o, t in
                 zip(ref_model(inputs).chunk(num_microbatches),
                     target.chunk(num_microbatches))]).mean().backward()
    naive_gap = max((p.grad - exact[n]).abs().max().item() / (1 + exact[n].abs().max().item())
                    for n, p in ref_model.named_parameters())
    return {"loss_err": None if result is None else abs(float(result) - float(ref_loss)),
            "grad_err": grad_err, "names": names, "naive_gap": naive_gap}


def hf_token_case(schedule: str, model_type: str = "llama") -> dict:
    """A tiny HF decoder with ``causal_lm_loss`` and unevenly padded rows, vs one forward."""
    from pp_core_builtins.transformers import causal_lm_loss
    from tests.cases.hf import tiny_model

    reference = tiny_model(model_type, 4)
    model = copy.deepcopy(reference)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=8, pp_microbatch_size=2,
                            loss_fn=causal_lm_loss, scale_grads_in_schedule=True)
    pipe = build_pipeline(model, config)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (8, 12), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((10, 10, 0, 0, 6, 6, 9, 9)):  # microbatches of unequal padding
        mask[row, :pad] = 0
    ids[mask == 0] = 0
    labels = ids.masked_fill(mask == 0, -100)
    inputs = {"input_ids": ids, "attention_mask": mask}
    result = pipe.step(inputs, target=labels)
    expected = causal_lm_loss(reference(**inputs).logits, labels)
    expected.backward()
    grads = grad_difference(pipe.model_parts, reference_grads(reference), tied_copies=True)
    assert not grads.missing, f"no gradient for {grads.missing}"
    worst = grads.worst
    return {"loss_err": None if result is None else abs(float(result) - float(expected)),
            "grad_err": worst}


def dp_token_case(schedule: str, engine: str = "helper") -> dict:
    """pp2 x dp2 on 4 ranks: each dp rank's half of the global batch has a very different number
    of valid targets; with ``meshes`` the mean over dp ranks of ``step``'s losses and the
    reduced gradients are the unsplit model's on the global batch."""
    import torch.distributed as dist

    from tests.cases.fsdp import dp_rank_and_size, pp_dp_meshes, wrap_parts

    run_meshes = pp_dp_meshes()
    dp_mesh = run_meshes.data_parallel_mesh()
    dp_rank, dp_size = dp_rank_and_size(dp_mesh)
    num_microbatches, local = 4, 8
    model = gpt(4)
    ref_model = copy.deepcopy(model)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=local, pp_microbatch_size=2,
                            loss_fn="cross_entropy", scale_grads_in_schedule=True)
    pipe = build_pipeline(model, config, meshes=run_meshes)
    wrap_parts(pipe, engine, dp_mesh, reshard_after_forward=False)
    # rank 0's half: microbatches of 1 and 8 valid targets per row; rank 1's: 4 and 2
    halves = [masked_batch(local, num_microbatches, seed=1, shift=0),
              masked_batch(local, num_microbatches, seed=2, shift=2)]
    halves[0][1][:, :-1] = -100  # and rank 0 keeps only the last target of every row
    inputs = torch.cat([h[0] for h in halves])
    target = torch.cat([h[1] for h in halves])
    loss = pipe.step(inputs[dp_rank * local:(dp_rank + 1) * local],
                     target=target[dp_rank * local:(dp_rank + 1) * local])
    ref_loss = cross_entropy(ref_model(inputs), target)
    ref_loss.backward()
    loss_err = None
    if loss is not None:
        dist.all_reduce(loss, group=dp_mesh.get_group())
        loss_err = abs(float(loss) / dp_size - float(ref_loss))
    grad_err, names = _grad_errors(pipe, ref_model, 1.0)
    return {"loss_err": loss_err, "grad_err": grad_err, "names": names}
