"""The demo GPT: token + position embeddings, pre-norm transformer blocks, final norm, head.

It follows pp-core's ``layers`` contract so the ``layers`` splitter can cut it anywhere: the
embeddings are registered before ``layers`` (they go to the first stage), ``norm`` and ``output``
after it (the last stage), and ``forward`` skips whichever of them a model part holds as ``None``.
The same ``forward`` therefore runs the whole model (``tokens -> logits``), the first stage
(``tokens -> hidden``), a middle stage (``hidden -> hidden``) or the last (``hidden -> logits``).

Packed rows (docs/data.md): ``forward(input_ids, position_ids)`` with position ids that restart
at 0 where a document starts. The position embedding reads them, and attention is causal within
a document and blocked across documents (a boolean SDPA mask built from them: a new document
starts wherever a position id is not its predecessor's plus one, the rule Hugging Face's masks
use). A stage that is not the last then returns ``(hidden, position_ids)``, so every stage gets
its microbatch's own boundaries, in whatever order the schedule runs microbatches.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as functional
from torch import nn

from pp_core import current_seq_slice
from pp_core_builtins.models.arg_types import check_arg_types

__all__ = ["GPT", "Block", "uneven_gpt", "document_mask"]


def document_mask(position_ids: torch.Tensor, queries: Optional[int] = None) -> torch.Tensor:
    """``[batch, 1, seq, seq]`` bool: query ``i`` may attend key ``j`` iff ``j <= i`` and both
    lie in the same document (documents split where ``position_ids`` does not step by 1).
    ``queries``: the rows of the last ``queries`` tokens only (a sequence slice's block against
    its prefix), ``[batch, 1, queries, seq]``."""
    first = position_ids[:, :1] - 1
    document = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    seq = position_ids.shape[-1]
    queries = seq if queries is None else queries
    rows = torch.arange(seq - queries, seq, device=position_ids.device)[:, None]
    causal = torch.arange(seq, device=position_ids.device)[None, :] <= rows
    return ((document[:, -queries:, None] == document[:, None, :]) & causal)[:, None]


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention, then an MLP, each residual."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.init_attention(dim, num_heads)
        self.ffn = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim, bias=False), nn.GELU(),
            nn.Linear(mlp_ratio * dim, dim, bias=False),
        )

    def init_attention(self, dim: int, num_heads: int) -> None:
        """The attention half and the feed-forward's norm (registered in this order, so every
        block kind keeps the same parameter names before its feed-forward)."""
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attention_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``mask``: a :func:`document_mask` (packed rows), else plain causal attention."""
        x = self.attend(x, mask)
        return x + self.ffn(self.ffn_norm(x))

    def attend(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` plus its self-attention (the block's first residual; every block kind shares it).

        Shapes come from the projection, not from ``x``: under tensor parallelism (tp_plan.py) a
        rank holds [q, k, v] of its heads only, and with sequence parallelism ``x`` is a
        sequence shard."""
        qkv = self.qkv(self.attention_norm(x))
        batch, seq, width = qkv.shape
        q, k, v = qkv.split(width // 3, dim=-1)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        piece = current_seq_slice()
        if piece is not None:  # a sequence slice: attend over the earlier slices' keys too
            attended = piece.attention(self, q, k, v, mask)
        elif mask is None:
            attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            attended = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width // 3))


class GPT(nn.Module):
    """A small decoder-only language model: ``forward(tokens [B, S]) -> logits [B, S, vocab]``.

    Sequence slices (``pipeline.pp_seq_chunks``): under a current
    :func:`pp_core.current_seq_slice` a forward takes one slice; positions continue from the
    slice's offset, attention reads the earlier slices' keys and values, and a packed row's
    document mask is built from the whole prefix's position ids."""

    pp_seq_slices = True

    def __init__(self, vocab_size: int = 256, dim: int = 64, num_layers: int = 4,
                 num_heads: int = 4, max_seq_len: int = 256, mlp_ratio: int = 4,
                 mlp_ratios: Optional[Sequence[int]] = None):
        """``mlp_ratios``: one MLP width factor per block instead of ``mlp_ratio`` for all
        (blocks of different cost, to exercise a split by measured time)."""
        check_arg_types("gpt", GPT.__init__, locals())
        super().__init__()
        ratios = [mlp_ratio] * num_layers if mlp_ratios is None else list(mlp_ratios)
        if len(ratios) != num_layers:
            raise ValueError(f"mlp_ratios has {len(ratios)} entries for num_layers={num_layers}; "
                             f"give one per block")
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, num_heads, ratio)
                                     for i, ratio in enumerate(ratios)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self._init_weights(num_layers)

    def _init_weights(self, num_layers: int) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)."""
        for name, param in self.named_parameters():
            if param.dim() < 2 or param.is_meta:  # a meta model has no values to initialise
                continue
            std = 0.02
            if name.endswith("proj.weight") or name.endswith("ffn.2.weight"):
                std = 0.02 / math.sqrt(2 * num_layers)
            nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None):
        """``input_ids`` on the first stage, the hidden states on later ones; ``position_ids``
        (packed rows) as described in the module docstring."""
        x = input_ids
        piece = current_seq_slice()
        if self.tok_embeddings is not None:
            if x.shape[1] > self.max_seq_len:
                raise ValueError(f"sequence length {x.shape[1]} exceeds max_seq_len="
                                 f"{self.max_seq_len}; raise model.args.max_seq_len")
            # [B, S] always (packed rows bring their own): one layout for the tp plan's shard
            start = 0 if piece is None else piece.offset(x.shape[1])
            positions = torch.arange(start, start + x.shape[1], device=x.device).expand(
                x.shape[0], -1) if position_ids is None else position_ids
            x = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                x = x + self.pos_embeddings(positions)
        mask = None if position_ids is None else document_mask(position_ids) if piece is None \
            else document_mask(piece.prefix(self, "position_ids", position_ids),
                               queries=position_ids.shape[-1])
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in layers:
            x = layer(x) if mask is None else layer(x, mask)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        elif position_ids is not None:  # the next stage needs the boundaries too
            return x, position_ids
        return x



def uneven_gpt(vocab_size: int = 8192, dim: int = 64, num_layers: int = 8, num_heads: int = 4,
               max_seq_len: int = 256, narrow: int = 1, wide: int = 8) -> GPT:
    """A GPT whose pieces cost very different times: a large vocabulary (a heavy embedding and
    head) and blocks of two widths, the first half with MLP factor ``narrow``, the second half
    ``wide``. Splitting it by block count leaves the last stage far slower than the first; the
    ``balanced`` splitter cuts by measured time instead (``benchmarks/bench_balanced.py``)."""
    half = num_layers // 2
    return GPT(vocab_size, dim, num_layers, num_heads, max_seq_len,
               mlp_ratios=[narrow] * half + [wide] * (num_layers - half))
