"""Backward passes of one stage and one microbatch: full (B), input-only (I), weight-only (W).

Zero-bubble schedules split a backward in two: ``I`` computes the gradients of the stage inputs
(the previous stage is waiting for them), ``W`` later computes the parameter gradients (it only
fills bubbles). ``W`` must not redo work ``I`` already did.

How the split works. Autograd computes only what the requested inputs need, so ``I`` is
``autograd.grad(outputs, stage_inputs, retain_graph=True)``: every node on a path from the
outputs to the inputs runs, and nodes whose only job is a parameter gradient do not. The nodes
where the parameter side branches off that path - the *boundary* nodes (for ``y = x @ w`` the
matmul's backward, which gives ``dx`` during ``I`` and ``dw`` during ``W``) - see their incoming
gradient during ``I``; a pre-hook keeps it. ``W`` then restarts autograd at those nodes with the
kept gradients and only the parameters as inputs, so nothing on the input path runs again.
Parameters are grouped by the boundary nodes they hang from, and each group gets its own
``autograd.backward`` call: one call for several groups would make autograd recompute the input
path between their boundary nodes (torch's ``stage_backward_weight`` groups the same way). When
no stage input needs a gradient (the first stage) ``I`` has nothing to do and ``W`` runs the whole
backward. Non-tensor and non-differentiable inputs are skipped. A group can hang from several
nodes of the input path, one below another (on a first stage with sequence slices the embedding
feeds both the residual stream and the first attention, which reads earlier slices' keys and
values, inputs of ``I``): its ``W`` runs the input path between them again, each boundary node
clamped to the gradient ``I`` kept there, through nodes other groups restart at, so such a ``W``
keeps the graph until its last group has run.

Fused boundary nodes. Some nodes compute every gradient whenever they run, whatever autograd
asked for: the backward of a ``torch.compile``d region (``CompiledFunctionBackward``, one node
for the whole compiled block) and custom ``autograd.Function``s. Re-running such a node in ``W``
would redo its whole backward, and torch refuses to re-run a compiled backward that was built
with donated buffers (its saved tensors are reused in place; pytorch#161904). So ``I`` also keeps
what each boundary node gave its parameter side (a post-hook); when every boundary node of a
group gave all of it, ``W`` restarts below them, at the parameter-side edges, and the fused
node runs exactly once. ``I`` runs with ``torch._functorch.config.donated_buffer`` off: that
switch only lifts torch's refusal to run a donated compiled backward with ``retain_graph=True``
(and compiles a backward built during ``I`` without donation), which is safe because the node
never runs again. A group that mixes fused and ordinary nodes re-runs them all (correct when
donation is off); with donation on it is refused with a message saying what to do.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge

from pp_core._torch_compat import ACCUMULATE_GRAD as _ACCUMULATE_GRAD
from pp_core._torch_compat import donated_buffers_off, donated_buffers_on
from pp_core._torch_compat import engine_run_backward as _engine
from pp_core.errors import PipelineError

__all__ = ["backward_full", "backward_input", "backward_weight", "WeightGrad"]


def _grads_or_ones(outputs, grads):
    if grads is None:
        return tuple(torch.ones_like(out) for out in outputs)
    return tuple(grads)


def _run(roots, grads, inputs=(), retain_graph=False, accumulate_grad=True):
    """Run autograd from ``roots`` (tensors or GradientEdges) with explicit ``grads``."""
    if _engine is not None:
        return _engine(tuple(roots), tuple(grads), retain_graph, False, tuple(inputs),
                       allow_unreachable=True, accumulate_grad=accumulate_grad)
    if accumulate_grad:
        torch.autograd.backward(list(roots), list(grads), retain_graph=retain_graph,
                                inputs=list(inputs) or None)
        return None
    return torch.autograd.grad(list(roots), list(inputs), list(grads), retain_graph=retain_graph,
                               allow_unused=True)


def _input_grads(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    grads = []
    for x in inputs:
        grad = x.grad
        grads.append(torch.zeros_like(x) if grad is None else grad)
        x.grad = None
    return grads


def backward_full(outputs: Sequence[torch.Tensor], grads: Optional[Sequence[torch.Tensor]],
                  inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Accumulate parameter gradients; return the gradient of every tensor in ``inputs``.

    :param outputs: the stage outputs that require grad (the scaled loss on the last stage).
    :param grads: their gradients (``None`` for a scalar loss).
    :param inputs: the stage inputs that require grad (leaf tensors made by the runtime).
    """
    if outputs:
        _run(outputs, _grads_or_ones(outputs, grads))
    return _input_grads(inputs)


class WeightGrad:
    """What ``I`` leaves for ``W``: per parameter group, the boundary edges and their gradients."""

    __slots__ = ("groups", "full")

    def __init__(self, groups=None, full=None):
        self.groups = groups or []
        self.full = full  # (outputs, grads) when W must run the whole backward


def _node_of_leaf(node) -> Optional[torch.Tensor]:
    if _ACCUMULATE_GRAD is not None:  # a type check: getattr on every node raises and is slow
        return node.variable if type(node) is _ACCUMULATE_GRAD else None
    return getattr(node, "variable", None)


def backward_input(outputs: Sequence[torch.Tensor], grads: Optional[Sequence[torch.Tensor]],
                   inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], WeightGrad]:
    """Input gradients only; returns them and the state :func:`backward_weight` needs."""
    outputs = list(outputs)
    if not inputs:
        return [], WeightGrad(full=(outputs, grads))
    if not outputs:
        return [torch.zeros_like(x) for x in inputs], WeightGrad()
    grad_list = _grads_or_ones(outputs, grads)
    roots, parents, input_nodes, param_nodes = _graph(outputs, grad_list, inputs)
    on_path = _on_path(input_nodes, parents)
    groups = _parameter_groups(param_nodes, parents, on_path, roots)

    # 4. I: keep what reaches the boundary nodes on the path, and what they give the parameters.
    captured: dict = {}
    gave: dict = {}  # boundary node -> [(GradientEdge, grad)] on its parameter side
    handles = []
    for group in groups:
        for node in group["nodes"]:
            if node in on_path:
                handles.append(node.register_prehook(
                    lambda grad_outputs, node=node: captured.__setitem__(node, grad_outputs)))
                handles.append(node.register_hook(
                    lambda grad_inputs, grad_outputs, node=node:
                    _keep_parameter_side(node, grad_inputs, on_path, gave)))
    try:
        wanted = [x for x in inputs if x.requires_grad]
        with donated_buffers_off():
            result = _run(outputs, grad_list, wanted, retain_graph=True, accumulate_grad=False)
    finally:
        for handle in handles:
            handle.remove()
    by_id = dict(zip(map(id, wanted), result))
    input_grads = []
    for x in inputs:
        grad = by_id.get(id(x))
        input_grads.append(torch.zeros_like(x) if grad is None else grad)
    return input_grads, WeightGrad(_weight_groups(groups, gave, captured, on_path, roots))


def _graph(outputs, grad_list, inputs):
    """1. The graph below the outputs: ``(roots, parents, input_nodes, param_nodes)``, the
    output nodes with their gradients, every node's parents, and the leaf nodes."""
    input_ids = {id(x) for x in inputs}
    roots: dict = {}  # node -> [(output_nr, grad)] for outputs that are not leaves
    for out, grad in zip(outputs, grad_list):
        if out.grad_fn is not None:
            roots.setdefault(out.grad_fn, []).append((out.output_nr, grad))
    parents: dict = {node: [] for node in roots}
    stack = list(roots)
    input_nodes, param_nodes = [], []
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            seen = parents.get(child)
            if seen is None:
                parents[child] = [node]
                variable = _node_of_leaf(child)
                if variable is not None:
                    (input_nodes if id(variable) in input_ids else param_nodes).append(child)
                else:
                    stack.append(child)
            else:
                seen.append(node)
    return roots, parents, input_nodes, param_nodes


def _on_path(input_nodes, parents) -> set:
    """2. Nodes on a path from an output to an input: they run during I."""
    on_path = set(input_nodes)
    stack = list(input_nodes)
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in on_path:
                on_path.add(parent)
                stack.append(parent)
    return on_path


def _parameter_groups(param_nodes, parents, on_path, roots) -> list[dict]:
    """3. Per parameter, walk up to the boundary (on-path nodes) and the output roots it
    reaches; parameters sharing a boundary node form one group."""
    group_of: dict = {}  # boundary node or root -> group dict
    groups: list[dict] = []
    for param_node in param_nodes:
        boundary, seen, stack = set(), {param_node}, [param_node]
        while stack:
            for parent in parents[stack.pop()]:
                if parent in seen:
                    continue
                seen.add(parent)
                if parent in on_path:
                    boundary.add(parent)
                    continue
                if parent in roots:
                    boundary.add(parent)
                stack.append(parent)
        if not boundary:
            continue
        found = {id(group_of[n]): group_of[n] for n in boundary if n in group_of}
        group = {"params": [param_node.variable], "nodes": set(boundary)}
        for other in found.values():
            group["params"] += other["params"]
            group["nodes"] |= other["nodes"]
            other["merged"] = True
        for node in group["nodes"]:
            group_of[node] = group
        groups.append(group)
    return [g for g in groups if not g.get("merged")]


def _weight_groups(groups, gave, captured, on_path, roots) -> list:
    """5. W's roots: boundary edges with the gradient they saw, plus the outputs they hang
    from; below the boundary when every boundary node of the group already gave its parameter
    side."""
    weight_groups = []
    for group in groups:
        if all(node in gave for node in group["nodes"]):
            edges = [edge for node in group["nodes"] for edge, _ in gave[node]]
            edge_grads = [grad for node in group["nodes"] for _, grad in gave[node]]
            weight_groups.append((edges, edge_grads, group["params"], None))
            continue
        _check_rerun([node for node in group["nodes"] if node in gave], group["params"])
        edges, edge_grads, clamps = [], [], []
        for node in group["nodes"]:
            if node in on_path:
                kept = captured.get(node)
                if kept is None:
                    continue
                clamps.append((node, kept))
                for index, grad in enumerate(kept):
                    if grad is not None:
                        edges.append(GradientEdge(node, index))
                        edge_grads.append(grad)
            else:
                for output_nr, grad in roots[node]:
                    edges.append(GradientEdge(node, output_nr))
                    edge_grads.append(grad)
        if edges:
            weight_groups.append((edges, edge_grads, group["params"],
                                  clamps if len(group["nodes"]) > 1 else None))
    return weight_groups


def _keep_parameter_side(node, grad_inputs, on_path, gave) -> None:
    """Post-hook of a boundary node during ``I``: keep its parameter-side gradients when it
    computed all of them (a fused node, see the module docstring)."""
    kept = []
    computes_all = type(node).__name__ == "CompiledFunctionBackward"  # None: no gradient
    for (child, input_nr), grad in zip(node.next_functions, grad_inputs):
        if child is None or child in on_path or (grad is None and computes_all):
            continue
        if grad is None:
            return
        kept.append((GradientEdge(child, input_nr), grad))
    if kept:
        gave[node] = kept


def _check_rerun(fused: list, params: list) -> None:
    """Refuse to run a compiled backward a second time while torch may have donated its buffers."""
    compiled = [node for node in fused if type(node).__name__ == "CompiledFunctionBackward"]
    if not compiled:
        return
    if donated_buffers_on():
        shapes = ", ".join(str(tuple(p.shape)) for p in params[:4])
        raise PipelineError(
            f"split backward (I/W) would run a torch.compile'd backward twice: parameters of "
            f"shapes {shapes} are used both inside a compiled region and outside it, and the "
            f"compiled backward may have donated its buffers; compile the module that uses them "
            f"as a whole, turn torch's buffer donation off (functorch config donated_buffer="
            f"False) before the first step (pp_core.parallel.apply_compile does), or use a "
            f"schedule without split backward (1f1b, interleaved_1f1b)")


def backward_weight(state: WeightGrad) -> None:
    """Accumulate the parameter gradients ``I`` left pending."""
    if state.full is not None:
        outputs, grads = state.full
        if outputs:
            _run(outputs, _grads_or_ones(outputs, grads))
        return
    # a group with clamps runs the input path between its boundary nodes again, through nodes
    # other groups restart at: the graph is kept until the last group has run (it goes with
    # ``state.groups`` right after, so the peak is unchanged)
    retain = any(clamps for *_, clamps in state.groups)
    for edges, grads, params, clamps in state.groups:
        handles = []
        if clamps:  # a boundary node below another one must see exactly its kept gradient
            for node, kept in clamps:
                handles.append(node.register_prehook(lambda grad_outputs, kept=kept: kept))
        try:
            _run(edges, grads, params, retain_graph=retain)
        finally:
            for handle in handles:
                handle.remove()
    state.groups = []
