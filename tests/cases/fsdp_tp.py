"""What the FSDP2 x TP test runs on every one of 8 ranks: pp2 x dp_shard2 x tp2 on the mesh
``pp-core run`` builds (tp innermost). :func:`pp_core.parallel.parallelize` shards each stage's
parts over ``mesh["tp"]`` (the demo GPT's built-in plan: the fused ``qkv`` a strided shard), then
over ``mesh["dp_shard"]`` (FSDP2: parameters become DTensors on the 2-D (dp_shard, tp) mesh); one step on a global batch
against the unsplit model on one process. Module-level functions, picklable results.

The fused ``qkv`` weight is a strided shard on tp (``_StridedShard(0, sf=3)``: tp rank r holds
``[q_r; k_r; v_r]``) that FSDP2 shards again along rows over dp; torch 2.13's ``full_tensor()``
of that nested placement puts the rows in the wrong order, so its gradient is assembled from the
local shards by hand (:func:`strided_whole`).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from pp_core import PipelineConfig, build_pipeline
from pp_core.losses import resolve_loss
from tests.cases.runtime import batch, gpt, reference

GLOBAL_BATCH = 8


def strided_whole(locals_: dict, chunks: int) -> torch.Tensor:
    """The whole fused weight from its local pieces ``{(dp, tp): rows}``: FSDP2 splits each tp
    rank's ``[q_r; k_r; v_r]`` along rows over dp; the whole is ``[q_0; q_1; k_0; ...]``."""
    dps = 1 + max(d for d, _ in locals_)
    tps = 1 + max(t for _, t in locals_)
    per_tp = [torch.cat([locals_[(d, t)] for d in range(dps)]) for t in range(tps)]
    return torch.cat([piece for j in range(chunks) for piece in
                      (rows.chunk(chunks)[j] for rows in per_tp)])


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A TP-only DTensor's whole value (its one strided shard ``full_tensor()`` gets right)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / (want.abs().max() + 1e-6)).item()


def fsdp_tp_case(schedule: str, microbatch_size: int = 2) -> dict:
    """One step of pp2 x dp_shard2 x tp2 with ``schedule``: this rank's loss and its worst
    relative gradient error against one process (``qkv`` assembled by hand, the rest
    ``full_tensor()``), the parameters it covers and the placements its gradients have."""
    from pp_core.parallel import parallelize
    from tests.cases.meshes import meshes

    run_meshes = meshes(pp=2, dp_shard=2, tp=2)
    mesh = run_meshes.mesh
    model = gpt(4)
    ref_model = copy.deepcopy(model)
    local = GLOBAL_BATCH // 2
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=local,
                            pp_microbatch_size=microbatch_size, loss_fn="cross_entropy",
                            scale_grads_in_schedule=True)
    pipe = build_pipeline(model, config, meshes=run_meshes)
    done = parallelize(pipe, run_meshes)  # tp, then FSDP2 over dp_shard
    modules, units = done.tensor_parallel, done.data_parallel_units
    inputs, target = batch("gpt", GLOBAL_BATCH, seed=1)
    dp_rank = mesh["dp_shard"].get_local_rank()
    mine = slice(dp_rank * local, (dp_rank + 1) * local)
    loss = pipe.step(inputs[mine], target=target[mine])
    ref_loss = reference(ref_model, resolve_loss("cross_entropy"), inputs, target,
                         GLOBAL_BATCH // microbatch_size, scale=True)
    ref_params = dict(ref_model.named_parameters())
    grad_err, names, placements, qkv = 0.0, [], set(), []
    for part in pipe.model_parts:
        for name, param in part.named_parameters():
            names.append(name)
            placements.add(str(param.grad.placements))
            if name.endswith("qkv.weight"):  # full_tensor() misorders its rows: by hand, below
                qkv.append((name, param.grad.to_local().detach()))
            else:
                grad_err = max(grad_err, _rel(param.grad.full_tensor(), ref_params[name].grad))
    coords = (dp_rank, mesh["tp"].get_local_rank())
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (coords, qkv))
    for name in {n for _, mine_ in pieces for n, _ in mine_}:
        whole = strided_whole({c: g for c, mine_ in pieces for n, g in mine_ if n == name}, 3)
        grad_err = max(grad_err, _rel(whole, ref_params[name].grad))
    return {"loss": None if loss is None else float(loss), "ref_loss": ref_loss,
            "grad_err": grad_err, "names": names, "modules": modules, "units": units,
            "placements": sorted(placements)}


def fsdp_tp_matrix(schedules: list) -> dict:
    """:func:`fsdp_tp_case` for each schedule in one pool call."""
    return {schedule: fsdp_tp_case(schedule) for schedule in schedules}


def _sgd(parts):
    return [torch.optim.SGD(part.parameters(), lr=0.1, momentum=0.9) for part in parts]


def _fresh(layout: str):
    """A pipeline of the demo GPT at ``fsdp_tp`` (pp2 x dp_shard2 x tp2) or ``tp`` (pp2 x tp2,
    two copies), its SGD optimizers, and its mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from pp_core.parallel import apply_tensor_parallel, parallelize
    from tests.cases.meshes import meshes

    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=GLOBAL_BATCH // 2,
                            pp_microbatch_size=2, loss_fn="cross_entropy",
                            scale_grads_in_schedule=True)
    if layout == "fsdp_tp":
        run_meshes = meshes(pp=2, dp_shard=2, tp=2)
        pipe = build_pipeline(gpt(4), config, meshes=run_meshes)
        parallelize(pipe, run_meshes)
        return pipe, _sgd(pipe.model_parts), run_meshes.mesh
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("copy", "pp", "tp"))
    pipe = build_pipeline(gpt(4), config, pp_group=mesh["pp"])
    apply_tensor_parallel(pipe.model_parts, mesh["tp"])
    return pipe, _sgd(pipe.model_parts), mesh


def _locals(parts, optimizers) -> dict:
    """This rank's local shards of every weight and momentum buffer."""
    found = {}
    for part, optimizer in zip(parts, optimizers):
        for name, param in part.named_parameters():
            found[name] = param.detach().to_local().clone()
            buffer = optimizer.state.get(param, {}).get("momentum_buffer")
            if buffer is not None:
                found[f"{name}.momentum"] = buffer.to_local().clone()
    return found


def fsdp_tp_checkpoint(directory: str) -> dict:
    """One SGD-with-momentum step at pp2 x dp_shard2 x tp2, a DCP checkpoint of it, then that
    checkpoint loaded into the same layout (zeroed first) and into pp2 x tp2 (no FSDP): the local
    shards saved and reloaded, and the whole weights and momenta pp2 x tp2 loaded."""
    from pp_core.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint

    pipe, optimizers, mesh = _fresh("fsdp_tp")
    inputs, target = batch("gpt", GLOBAL_BATCH, seed=1)
    dp_rank = mesh["dp_shard"].get_local_rank()
    local = GLOBAL_BATCH // 2
    pipe.step(inputs[dp_rank * local:(dp_rank + 1) * local],
              target=target[dp_rank * local:(dp_rank + 1) * local])
    for optimizer in optimizers:
        optimizer.step()
    save_checkpoint(directory, 1, pipe.model_parts, optimizers)
    saved = _locals(pipe.model_parts, optimizers)
    path = str(checkpoint_path(directory, 1))
    loaded = {}
    for layout in ("fsdp_tp", "tp"):
        again, again_optimizers, again_mesh = _fresh(layout)
        with torch.no_grad():
            for part in again.model_parts:
                for param in part.parameters():
                    param.zero_()
        load_checkpoint(path, again.model_parts, again_optimizers,
                        process_group=again_mesh["pp"].get_group())
        if layout == "fsdp_tp":
            reloaded = _locals(again.model_parts, again_optimizers)
        else:
            for part, optimizer in zip(again.model_parts, again_optimizers):
                for name, param in part.named_parameters():
                    loaded[name] = _whole(param.detach())
                    loaded[f"{name}.momentum"] = _whole(optimizer.state[param]["momentum_buffer"])
    return {"saved": saved, "reloaded": reloaded, "loaded": loaded}


def sgd_reference() -> dict:
    """The unsplit model after the same SGD-with-momentum step on the whole global batch (its
    microbatches of 2, mean loss): ``{name: weight}`` and ``{name.momentum: buffer}``."""
    model = gpt(4)
    (optimizer,) = _sgd([model])
    inputs, target = batch("gpt", GLOBAL_BATCH, seed=1)
    reference(model, resolve_loss("cross_entropy"), inputs, target, GLOBAL_BATCH // 2,
              scale=True)
    optimizer.step()
    state = {name: param.detach().clone() for name, param in model.named_parameters()}
    state.update({f"{name}.momentum": optimizer.state[param]["momentum_buffer"].clone()
                  for name, param in model.named_parameters()})
    return state
