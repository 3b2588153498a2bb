"""``moe_gpt``: the demo GPT with mixture-of-experts feed-forward blocks.

Each block is the GPT block's attention followed by :class:`MoE`: a top-k router over
``num_experts`` experts (GELU MLPs, weights stacked ``[experts, ...]``), an optional shared expert
every token passes through, and dropless routing - every token reaches its ``top_k`` experts, no
capacity factor, so a split, an ep degree or a microbatch size never changes the result. The
``layers`` contract is the GPT's (:mod:`pp_core_builtins.models.gpt`), so every splitter, the
planner, activation checkpointing and compile apply.

Losses. Each MoE layer adds ``aux_loss_coef`` times the load-balancing loss
``num_experts * sum_e f_e * p_e`` (``f_e``: share of routed slots that went to expert ``e``,
``p_e``: mean router probability of ``e``; Switch / Megatron) and ``z_loss_coef`` times the
router z-loss ``mean(logsumexp(logits)^2)``, computed on the microbatch the layer sees (this
rank's tokens), to the loss *as if added to the last stage's microbatch loss*: the gradient is
injected in the layer's own backward, scaled as the running step scales the loss (the layer's
``pp_aux_loss_scale``, handed over by the executor: :mod:`pp_core.parallel.expert.aux_loss`),
wherever the layer's stage sits. The values are kept for the metrics (``pp_aux_losses``;
:func:`pp_core.losses.pop_aux_losses`).

Expert parallelism: :meth:`MoE.shard_experts` keeps this ep rank's ``num_experts / ep_size``
experts; tokens travel to them and back with ``all_to_all_single`` - all of it the library's
(:mod:`pp_core.parallel.expert`); this module holds only the model and its plan. The model's
:meth:`MoEGPT.expert_parallel_plan` is what the core plugin answers ``pp_expert_parallel_plan``
with.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as functional
from torch import nn

from pp_core.losses import pop_aux_losses
from pp_core.parallel.expert import (DispatchWorkspaceInitializer, dispatch_to_experts,
                                     group_name, inject_aux_loss, shard_stacked_experts,
                                     workspace_for)
from pp_core_builtins.models.arg_types import check_arg_types
from pp_core_builtins.models.gpt import GPT, Block

__all__ = ["MoE", "MoEBlock", "MoEGPT", "GroupedExperts", "ShardExperts", "pop_aux_losses",
           "WORKSPACE_NAME"]

WORKSPACE_NAME = "pp_core_builtins.moe.dispatch_workspace"  # the key of moe_gpt's workspaces


class GroupedExperts(nn.Module):
    """``num_experts`` GELU MLPs as two stacked weights ``w1 [E, dim, hidden]``,
    ``w2 [E, hidden, dim]``; ``forward(x, counts)`` runs rows grouped by expert."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for expert, rows in enumerate(torch.split(x, counts)):
            if rows.shape[0]:  # an expert with no tokens contributes no node (grad stays None)
                outs.append(functional.gelu(rows @ self.w1[expert]) @ self.w2[expert])
        return torch.cat(outs) if outs else x.new_zeros((0, x.shape[-1])) + 0 * x.sum()


class MoE(nn.Module):
    """Top-k routed experts (dropless) plus an optional shared expert."""

    def __init__(self, dim: int, num_experts: int, top_k: int, hidden: int,
                 shared_expert: bool = False, aux_loss_coef: float = 0.01,
                 z_loss_coef: float = 0.0, normalize_top_k: bool = True):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.normalize_top_k = normalize_top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden)
        self.shared = nn.Sequential(nn.Linear(dim, hidden, bias=False), nn.GELU(),
                                    nn.Linear(hidden, dim, bias=False)) if shared_expert else None
        self.ep_group, self.ep_size, self.ep_rank = None, 1, 0
        self.pp_aux_losses: list[torch.Tensor] = []  # detached, one per training forward
        self.pp_aux_loss_scale = 1.0  # the running step's (pp_core.parallel.expert.aux_loss)

    # ------------------------------------------------------------------ expert parallelism
    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def shard_experts(self, ep_group) -> None:
        """Keep this ep rank's contiguous ``num_experts / ep_size`` experts (in place)."""
        if self.ep_size != 1:
            raise ValueError("this MoE layer's experts are sharded already")
        _, rank, size = shard_stacked_experts(self.experts, ("w1", "w2"), self.num_experts,
                                              ep_group)
        self.ep_group, self.ep_size, self.ep_rank = ep_group, size, rank

    # ------------------------------------------------------------------ the initializer
    def workspace_key(self) -> tuple:
        return (WORKSPACE_NAME, group_name(self.ep_group))

    def workspace_signature(self) -> tuple:
        dtype = str(self.router.weight.dtype).removeprefix("torch.")
        return (self.dim, dtype, self.top_k, self.experts_per_rank, self.ep_size)

    def pipeline_runtime_initializers(self):
        return [DispatchWorkspaceInitializer(self.workspace_key(), self.workspace_signature())]

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens, k = x.shape[0], self.top_k
        logits = self.router(x).float()
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if x.is_meta:  # no routing without values: shapes (and costs) as if all went to one
            out = self.experts(x.repeat(k, 1), [tokens * k] + [0] * (self.num_experts - 1))
            out = out[:tokens] + (self.shared(x) if self.shared is not None else 0)
            return out.reshape(shape)
        workspace = workspace_for(self.workspace_key(), self.workspace_signature())
        out, counts = dispatch_to_experts(x, chosen, weights, self.num_experts, self.experts,
                                          self.ep_group, workspace)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.training and torch.is_grad_enabled():
            aux = self._aux_loss(logits, probs, counts, tokens)
            if not _in_backward():  # an activation-checkpoint recompute is not a new forward
                self.pp_aux_losses.append(aux.detach())
            out = inject_aux_loss(out, aux, self.pp_aux_loss_scale)
        return out.reshape(shape)

    def _aux_loss(self, logits, probs, counts, tokens: int) -> torch.Tensor:
        share = counts.float() / float(tokens * self.top_k)
        aux = self.aux_loss_coef * self.num_experts * (share * probs.mean(dim=0)).sum()
        if self.z_loss_coef:
            aux = aux + self.z_loss_coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return aux


def _in_backward() -> bool:
    current = getattr(torch._C, "_current_graph_task_id", None)  # private; absent: assume not
    return current is not None and current() != -1


class MoEBlock(Block):
    """The GPT block with :class:`MoE` as its feed-forward (attention is :class:`Block`'s)."""

    def __init__(self, dim: int, num_heads: int, moe: MoE):
        nn.Module.__init__(self)
        self.init_attention(dim, num_heads)
        self.moe = moe

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.attend(x, mask)
        return x + self.moe(self.ffn_norm(x))


class MoEGPT(GPT):
    """The demo GPT (:class:`~pp_core_builtins.models.gpt.GPT`) with MoE blocks."""

    def __init__(self, vocab_size: int = 256, dim: int = 64, num_layers: int = 4,
                 num_heads: int = 4, max_seq_len: int = 256, mlp_ratio: int = 4,
                 num_experts: int = 8, top_k: int = 2, moe_hidden: int | None = None,
                 shared_expert: bool = False, aux_loss_coef: float = 0.01,
                 z_loss_coef: float = 0.0, normalize_top_k: bool = True):
        check_arg_types("moe_gpt", MoEGPT.__init__, locals())
        for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"moe_gpt: {name}={value!r} must be a finite number >= 0 (a "
                                 f"coefficient of a loss added to the model's)")
        if moe_hidden is not None and moe_hidden < 1:
            raise ValueError(f"moe_gpt: moe_hidden={moe_hidden} must be at least 1 (the experts' "
                             f"hidden width), or left out for mlp_ratio * dim")
        nn.Module.__init__(self)
        # the router's losses are means over a forward's tokens: exact over slices only when off
        self.pp_seq_slices = aux_loss_coef == 0 and z_loss_coef == 0
        hidden = moe_hidden or mlp_ratio * dim
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleDict({
            str(i): MoEBlock(dim, num_heads, MoE(dim, num_experts, top_k, hidden, shared_expert,
                                                 aux_loss_coef, z_loss_coef, normalize_top_k))
            for i in range(num_layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self._init_weights(num_layers)

    def _init_weights(self, num_layers: int) -> None:
        super()._init_weights(num_layers)  # N(0, 0.02) for every matrix, stacked experts too
        for name, param in self.named_parameters():
            if name.endswith("experts.w2") and not param.is_meta:
                nn.init.normal_(param, mean=0.0, std=0.02 / (2 * num_layers) ** 0.5)

    def expert_parallel_plan(self) -> dict:
        """``{module pattern: style}`` for :func:`pp_core.parallel.apply_expert_parallel`."""
        return {"layers.*.moe": ShardExperts()}


class ShardExperts:
    """The expert-parallel style of :class:`MoE`: :meth:`MoE.shard_experts` over the ep group."""

    def apply(self, module: nn.Module, ep_group) -> None:
        module.shard_experts(ep_group)
