"""Token dispatch for mixture-of-experts layers: the shared workspace and the all-to-all.

What a model's expert-parallel style builds on (``pp_core_builtins``' ``moe_gpt`` and Hugging Face
experts use it; a third-party MoE model imports it the same way, docs/plugins.md).

The dispatch workspace is the runtime initializer's job (``pp_core.runtime.initializers``): one
process-local :class:`DispatchWorkspace` per ``resource_key`` (the workspace name and the expert-
parallel group), however many MoE layers a rank's stages hold. Each layer returns a
:class:`DispatchWorkspaceInitializer` from ``pipeline_runtime_initializers()``;
``collect_pipeline_runtime_initializers`` keeps one per key and refuses two layers that share a key
with different ``signature`` s (hidden size, dtype, top-k, experts per rank, ep size). Before each
microbatch's first forward the executor calls ``prepare(num_tokens=..., device=...)``: the buffers
grow to a power of two of routed rows at least ``num_tokens * top_k`` and are reused afterwards, so
a run with changing lengths reallocates a few times at most.

What the workspace holds: the dispatch send buffer (``[rows, hidden]``, the permuted tokens are
written into it and handed to ``all_to_all_single``) and the count-exchange buffers. Nothing that
autograd saves for backward lives in it (a later microbatch overwrites it before an earlier one's
backward), so reuse is safe under every schedule.

Expert parallelism: :class:`AllToAll` sends variable splits forward and the reverse splits in
backward. It has no parameters, so under split backward the all-to-all runs in ``I`` (it is on
the path from the stage output to its input) and ``W`` (the expert matmuls' weight gradients)
stays local; on the first stage, whose ``I`` has no input to differentiate, ``W`` runs the whole
backward, all-to-alls included. Every rank of an ep group runs the same program (they are dp
peers), so the collectives meet in the same order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

__all__ = ["DispatchWorkspace", "DispatchWorkspaceInitializer", "workspace_for",
           "reset_workspaces", "AllToAll", "dispatch_to_experts", "group_name"]

_WORKSPACES: dict = {}


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


class DispatchWorkspace:
    """One process-local dispatch workspace; ``grows`` counts reallocations, ``prepared`` the
    ``num_tokens`` of every ``prepare`` (for tests and the validate report)."""

    def __init__(self, key, hidden_size: int, dtype: torch.dtype, top_k: int,
                 experts_per_rank: int, ep_size: int):
        self.key = key
        self.hidden_size, self.dtype, self.top_k = hidden_size, dtype, top_k
        self.experts_per_rank, self.ep_size = experts_per_rank, ep_size
        self.rows = 0
        self.device: Optional[torch.device] = None
        self.send: Optional[torch.Tensor] = None
        self.counts_out = self.counts_in = None
        self.grows = 0
        self.prepared: list[int] = []

    def prepare(self, num_tokens: int, device) -> None:
        self.prepared.append(int(num_tokens))
        self.ensure(int(num_tokens) * self.top_k, torch.device(device))

    def ensure(self, rows: int, device: torch.device) -> None:
        """At least ``rows`` routed rows on ``device``; grows to a power of two, never shrinks."""
        if rows <= self.rows and self.device == device:
            return
        self.rows = _next_power_of_two(max(rows, self.rows, 1))
        self.device = device
        self.send = torch.empty(self.rows, self.hidden_size, dtype=self.dtype, device=device)
        experts = self.experts_per_rank * self.ep_size
        self.counts_out = torch.empty(experts, dtype=torch.int64, device=device)
        self.counts_in = torch.empty(experts, dtype=torch.int64, device=device)
        self.grows += 1


def workspace_for(key, signature: tuple) -> DispatchWorkspace:
    """The process's workspace for ``key`` (made on first use)."""
    found = _WORKSPACES.get(key)
    if found is None:
        hidden, dtype_name, top_k, experts_per_rank, ep_size = signature
        found = _WORKSPACES[key] = DispatchWorkspace(key, hidden, getattr(torch, dtype_name),
                                                     top_k, experts_per_rank, ep_size)
    return found


def reset_workspaces() -> None:
    """Forget every workspace of this process (tests; a new model in the same process)."""
    _WORKSPACES.clear()


class DispatchWorkspaceInitializer:
    """The ``PipelineRuntimeInitializer`` of one MoE layer: its workspace key and signature."""

    def __init__(self, resource_key, signature: tuple):
        self.resource_key = resource_key
        self.signature = signature

    def prepare(self, num_tokens, device) -> None:  # keyword or positional calls alike
        workspace_for(self.resource_key, self.signature).prepare(num_tokens, device)

    def __repr__(self) -> str:
        return f"DispatchWorkspaceInitializer({self.resource_key!r}, {self.signature!r})"


def group_name(group) -> str:
    """A stable name of an ep group: its global ranks (``"local"`` without one)."""
    if group is None:
        return "local"
    return "ranks" + "-".join(str(r) for r in dist.get_process_group_ranks(group))


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, tensor, output_splits: list, input_splits: list, group, send_buffer=None):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        rows = sum(output_splits)
        out = tensor.new_empty((rows,) + tuple(tensor.shape[1:]))
        source = tensor
        if send_buffer is not None and send_buffer.dtype == tensor.dtype and \
                send_buffer.device == tensor.device and send_buffer.shape[0] >= tensor.shape[0] \
                and send_buffer.shape[1:] == tensor.shape[1:]:
            source = send_buffer[:tensor.shape[0]]  # the workspace: no fresh buffer per call
            source.copy_(tensor)
        with record_function("pp_core.moe.all_to_all"):
            dist.all_to_all_single(out, source.contiguous(), output_splits, input_splits,
                                   group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        with record_function("pp_core.moe.all_to_all"):
            dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits,
                                   group=ctx.group)
        return out, None, None, None, None


def dispatch_to_experts(x, chosen, weights, num_experts: int, experts, ep_group,
                        workspace: DispatchWorkspace):
    """Dropless top-k: ``sum_j weights[t, j] * expert_{chosen[t, j]}(x[t])`` for every token.

    :param x: ``[tokens, hidden]``; ``chosen``/``weights``: ``[tokens, k]`` expert ids / weights.
    :param experts: ``experts(rows, counts) -> rows``: this rank's experts on rows grouped by
        local expert (``counts[j]`` rows for local expert ``j``, in order).
    :param ep_group: the expert-parallel group (``None``: every expert is local).
    :returns: ``(output [tokens, hidden], counts per expert)``.
    """
    tokens, k = chosen.shape
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_index = order // k
    counts = torch.bincount(flat, minlength=num_experts)
    workspace.ensure(tokens * k, x.device)  # prepared already inside a pipeline step
    routed = x.index_select(0, token_index)
    if ep_group is None:
        out_rows = experts(routed, counts.tolist())
    else:
        out_rows = _expert_parallel(routed, counts, experts, ep_group, workspace)
    out_rows = out_rows * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(x.dtype)
    return torch.zeros_like(x).index_add(0, token_index, out_rows), counts


def _expert_parallel(routed, counts, experts, group, workspace: DispatchWorkspace):
    """Rows sorted by global expert -> their ranks (all-to-all), this rank's experts, back."""
    size = dist.get_world_size(group)
    local = counts.numel() // size
    workspace.counts_out.copy_(counts)
    with record_function("pp_core.moe.all_to_all"):
        dist.all_to_all_single(workspace.counts_in, workspace.counts_out, group=group)
    received = workspace.counts_in.view(size, local)  # [source rank, local expert]
    send_splits = counts.view(size, local).sum(dim=1).tolist()
    recv_splits = received.sum(dim=1).tolist()
    rows = AllToAll.apply(routed, recv_splits, send_splits, group, workspace.send)
    # rows arrive by source rank, then local expert: regroup by local expert
    expert_of_row = torch.arange(local, device=rows.device).repeat(size).repeat_interleave(
        received.reshape(-1))
    regroup = torch.argsort(expert_of_row, stable=True)
    grouped = experts(rows.index_select(0, regroup), received.sum(dim=0).tolist())
    back = torch.empty_like(regroup)
    back[regroup] = torch.arange(regroup.numel(), device=regroup.device)
    return AllToAll.apply(grouped.index_select(0, back), send_splits, recv_splits, group)
