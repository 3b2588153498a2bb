"""What the packed-sequence tests run on every rank (DistPool workers): rows that pack several
documents, their boundaries carried by position ids that restart at 0 per document, microbatches
of unequal document counts and lengths. A pipelined step against the unsplit model on one
process with the same rows; and a leak probe: change one document's tokens, and no other
document's outputs may move.
"""

from __future__ import annotations

import copy

import torch

from pp_core import PipelineConfig, build_pipeline
from pp_core.losses import cross_entropy
from tests.cases.compare import UNIT, grad_difference, reference_grads

SEQ = 8
# documents per row (lengths sum to SEQ), 2 rows per microbatch: 4 microbatches of unequal
# document counts (1-2, 4-4, 2-2, 1-2) and lengths
ROWS = [[8], [3, 5], [1, 1, 1, 5], [2, 2, 2, 2], [4, 4], [7, 1], [8], [1, 7]]


def packed_batch(vocab: int, seed: int = 1, rows=ROWS):
    """``({"input_ids", "position_ids"}, target)``: targets are the next token within the
    document, ``-100`` at each document's last token (never across a boundary)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(rows), SEQ + 1), generator=generator)
    positions = torch.zeros(len(rows), SEQ, dtype=torch.long)
    target = ids[:, 1:].clone()
    for row, lengths in enumerate(rows):
        at = 0
        for length in lengths:
            positions[row, at:at + length] = torch.arange(length)
            target[row, at + length - 1] = -100
            at += length
    return {"input_ids": ids[:, :-1].contiguous(), "position_ids": positions}, target


def _model(kind: str):
    if kind == "gpt":
        from pp_core_builtins.models.gpt import GPT

        torch.manual_seed(0)
        return GPT(vocab_size=32, dim=16, num_layers=4, num_heads=2, max_seq_len=16), 32
    from pp_core_builtins.transformers import hf_causal_lm
    from tests.cases.hf import tiny_config

    return hf_causal_lm(tiny_config(kind, 4), seed=0, attn_implementation="sdpa"), 64


def _logits(output):
    return output.logits if hasattr(output, "logits") else output


def packed_case(schedule: str, kind: str = "gpt", pool: bool = False) -> dict:
    """One packed step: loss and every gradient vs the unsplit model on the same rows."""
    model, vocab = _model(kind)
    reference = copy.deepcopy(model)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=8, pp_microbatch_size=2,
                            loss_fn="cross_entropy", scale_grads_in_schedule=True,
                            pp_recv_buffer_pool=pool, pp_seq_len=SEQ if pool else None)
    pipe = build_pipeline(model, config)
    inputs, target = packed_batch(vocab)
    loss = pipe.step(inputs, target=target)
    # an HF model detects packed rows from the position ids only without a KV cache (as every
    # pipeline stage runs); its own forward makes one unless told not to
    extra = {} if kind == "gpt" else {"use_cache": False}
    expected = cross_entropy(_logits(reference(**inputs, **extra)), target)
    expected.backward()
    grads = grad_difference(pipe.model_parts, reference_grads(reference), scale=UNIT,
                            tied_copies=True)
    assert not grads.missing, f"no gradient for {grads.missing}"
    worst = grads.worst
    return {"loss_err": None if loss is None else abs(float(loss) - float(expected)),
            "grad_err": worst}


def leak_case(schedule: str, kind: str = "gpt") -> dict:
    """Forward through the pipeline twice, the second time with the *first* document of every
    row changed: outputs of that document's tokens must change (the probe works), outputs of
    every later document must not (no token attends across a boundary)."""
    model, vocab = _model(kind)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=8, pp_microbatch_size=2,
                            loss_fn="cross_entropy")
    pipe = build_pipeline(model, config)
    inputs, _ = packed_batch(vocab)
    changed = {k: v.clone() for k, v in inputs.items()}
    first_doc = torch.zeros_like(inputs["position_ids"], dtype=torch.bool)
    for row, lengths in enumerate(ROWS):
        first_doc[row, : lengths[0]] = True
    changed["input_ids"][first_doc] = (inputs["input_ids"][first_doc] + 1) % vocab
    with torch.no_grad():
        before = pipe.eval_step(inputs)
        after = pipe.eval_step(changed)
    if before is None:
        return {"has_output": False}
    before, after = _logits(before), _logits(after)
    moved = (before - after).abs().amax(-1)  # [rows, seq]
    return {"has_output": True, "others_moved": moved[~first_doc].max().item(),
            "first_moved": moved[first_doc].min().item()}
