"""Expert parallelism for Hugging Face MoE decoders (Qwen2-MoE, Qwen3-MoE, Mixtral, ...).

transformers 5 keeps each sparse block's experts in one module holding stacked weights,
``gate_up_proj [experts, 2 * inter, hidden]`` and ``down_proj [experts, hidden, inter]``, called
as ``experts(hidden_states, top_k_index, top_k_weights)`` after the block's router. The plan
(:func:`expert_parallel_plan`, answered through ``pp_expert_parallel_plan``) names every such
module; :class:`ShardHFExperts` keeps this ep rank's experts and replaces the module's forward
with the library's dispatch (:func:`pp_core.parallel.expert.dispatch_to_experts`: dropless,
all-to-all there and back), as ``moe_gpt`` does; this module holds only the plan and its style. The router, and HF's own aux loss (computed by the
``...ForCausalLM`` head from every layer's router logits, which a pipeline does not carry: keep
``output_router_logits`` off), are untouched.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pp_core.parallel.expert import (dispatch_to_experts, group_name, shard_stacked_experts,
                                     workspace_for)

__all__ = ["expert_parallel_plan", "ShardHFExperts", "is_hf_experts"]

WORKSPACE = "pp_core_builtins.transformers.experts.dispatch_workspace"


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module with stacked ``gate_up_proj`` / ``down_proj`` weights."""
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter) and \
        up.dim() == 3 and down.dim() == 3 and hasattr(module, "num_experts")


def expert_parallel_plan(model: nn.Module) -> Optional[dict]:
    """``{fqn: ShardHFExperts()}`` for every experts module of ``model``; ``None`` without."""
    found = {fqn: ShardHFExperts() for fqn, module in model.named_modules()
             if is_hf_experts(module)}
    return found or None


class ShardHFExperts:
    """Keep this ep rank's experts of one transformers experts module; dispatch by all-to-all."""

    def apply(self, module: nn.Module, ep_group) -> None:
        total = module.num_experts
        local, _, size = shard_stacked_experts(module, ("gate_up_proj", "down_proj"), total,
                                               ep_group)
        signature = (module.gate_up_proj.shape[-1],
                     str(module.gate_up_proj.dtype).removeprefix("torch."), 1, local, size)
        key = (WORKSPACE, group_name(ep_group))

        def forward(hidden_states, top_k_index, top_k_weights):
            workspace = workspace_for(key, signature)
            out, _ = dispatch_to_experts(hidden_states, top_k_index, top_k_weights, total,
                                         lambda rows, counts: _local_experts(module, rows, counts),
                                         ep_group, workspace)
            return out

        module.forward = forward  # the instance's forward: nn.Module.__call__ runs it
        module.pp_ep_group, module.pp_ep_size = ep_group, size


def _local_experts(module: nn.Module, rows: torch.Tensor, counts: list) -> torch.Tensor:
    """transformers' expert MLP (gate/up, activation, down) on rows grouped by local expert."""
    outs = []
    for expert, chunk in enumerate(torch.split(rows, counts)):
        if chunk.shape[0]:
            gate, up = nn.functional.linear(chunk, module.gate_up_proj[expert]).chunk(2, dim=-1)
            outs.append(nn.functional.linear(module.act_fn(gate) * up, module.down_proj[expert]))
    return torch.cat(outs) if outs else rows.new_zeros((0, rows.shape[-1])) + 0 * rows.sum()
