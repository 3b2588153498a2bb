"""The attention of a sequence slice over its prefix (:mod:`pp_core.runtime.prefix_attention`):
the values and gradients of the plain concatenate-then-SDPA path, while autograd holds only the
per-slice pieces it was given (``peak_saved_bytes`` counts no new storage for the prefix)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as functional

from pp_core.runtime.prefix_attention import causal_block_mask, prefix_attention
from pp_core.runtime.saved_bytes import SavedBytes


def _pieces(kv_heads: int, count: int = 3, length: int = 4, seed: int = 0):
    """``q`` (4 heads, the last slice's queries) and ``count`` key and value pieces, each a view
    of one slice's projection (as a model's are), all requiring gradients."""
    gen = torch.Generator().manual_seed(seed)
    slices = [torch.randn(2, length, 4 + 2 * kv_heads, 8, generator=gen).transpose(1, 2)
              .requires_grad_() for _ in range(count)]
    keys = [s[:, 4:4 + kv_heads] for s in slices]
    values = [s[:, 4 + kv_heads:] for s in slices]
    return slices, slices[-1][:, :4], keys, values


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "recompute"])
@pytest.mark.parametrize("kv_heads, masked", [(4, False), (2, False), (4, True)],
                         ids=["causal", "grouped-query", "document-mask"])
def test_prefix_attention_equals_the_concatenated_attention(kv_heads, masked, kernel,
                                                            monkeypatch):
    """Both backwards: SDPA's CPU kernel called directly, and the recompute other devices
    take."""
    from pp_core.runtime import prefix_attention as module

    if not kernel:
        monkeypatch.setattr(module, "_on_cpu_kernel", lambda q: False)
    found = []
    for fused in (False, True):
        slices, q, keys, values = _pieces(kv_heads)
        mask = None
        if masked:  # a document ends after 5 of the 12 prefix tokens
            document = (torch.arange(12) >= 5).long()
            mask = (document[-4:, None] == document[None, :]) & causal_block_mask(4, 12, "cpu")
        if fused:
            out = prefix_attention(q, keys, values, mask)
        else:
            k, v = torch.cat(keys, 2), torch.cat(values, 2)
            if kv_heads != 4:
                k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
            out = functional.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_block_mask(4, 12, "cpu") if mask is None else mask)
        out.backward(torch.ones_like(out))
        found.append((out.detach(), [s.grad for s in slices]))
    torch.testing.assert_close(found[1][0], found[0][0], atol=1e-6, rtol=1e-6)
    for got, want in zip(found[1][1], found[0][1]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_prefix_attention_saves_the_pieces_not_their_concatenation():
    """The pieces' storages (the slices' projections, which the earlier slices hold anyway) are
    what it holds, with (on CPU) the output and log-sum-exp SDPA saves too; the plain path
    holds the concatenated keys and values besides."""
    held = {}
    for fused in (False, True):
        slices, q, keys, values = _pieces(4, count=4, length=16)
        meter = SavedBytes()
        with meter.measuring([]):
            out = prefix_attention(q, keys, values) if fused else \
                functional.scaled_dot_product_attention(
                    q, torch.cat(keys, 2), torch.cat(values, 2),
                    attn_mask=causal_block_mask(16, 64, "cpu"))
            held[fused] = meter.peak
            del out
    pieces = sum(s.untyped_storage().nbytes() for s in slices)
    output = 2 * 4 * 16 * 8 * 4 + 2 * 4 * 16 * 4  # [batch, heads, 16, head_dim], log-sum-exp
    assert pieces <= held[True] <= pieces + output  # CPU: SDPA's own output and lse
    concatenation = 2 * 4 * 64 * 8 * 4  # [batch, heads, 4 slices x 16, head_dim] fp32
    assert held[False] >= 2 * concatenation + slices[-1].untyped_storage().nbytes()


def test_hf_layers_route_their_sdpa_to_the_prefix_attention(monkeypatch):
    """A tiny HF Llama with grouped-query attention (4 heads, 2 key/value heads), K = 4: every
    later slice's SDPA call of every layer is answered by the prefix attention (the layer's
    ``SliceCache`` as a torch function mode), and the loss is K = 1's."""
    import copy

    pytest.importorskip("transformers")
    from pp_core import PipelineConfig, build_pipeline
    from pp_core.runtime import prefix_attention as module
    from pp_core_builtins.transformers import causal_lm_loss, hf_causal_lm
    from tests.cases.hf import batch, tiny_config

    calls = []
    apply = module.PrefixAttention.apply
    monkeypatch.setattr(module.PrefixAttention, "apply",
                        lambda *args: calls.append(len(args)) or apply(*args))
    model = hf_causal_lm(tiny_config("llama", 2), seed=0, attn_implementation="sdpa")
    inputs, labels = batch(4, padding=False)  # rows of 12 tokens: 4 slices of 3
    losses = {}
    for k in (1, 4):
        pipe = build_pipeline(copy.deepcopy(model), PipelineConfig(
            pp_schedule="gpipe", pp_batch_size=4, pp_microbatch_size=2, pp_seq_chunks=k,
            loss_fn=causal_lm_loss))
        losses[k] = float(pipe.step(inputs, target=labels))
    assert len(calls) == 2 * 3 * 2  # microbatches x later slices x layers
    assert abs(losses[4] - losses[1]) <= 1e-5
