"""What the pp x tp tests run on every rank: a pipeline over ``mesh["pp"]`` whose parts are
sharded over ``mesh["tp"]`` with :func:`pp_core.parallel.apply_tensor_parallel`, compared with
the unsplit model on one process (loss and every gradient, ``full_tensor()``). Module-level
functions with picklable results: they run in DistPool workers.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from pp_core import PipelineConfig, build_pipeline
from pp_core.losses import resolve_loss
from tests._runtime_cases import batch, reference

_MESH: dict = {}


def pp_tp_mesh(shape=(2, 2), names=("pp", "tp")):
    """The (pp, tp) mesh of the ranks (pp outermost, tp innermost), made once per group."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (id(dist.group.WORLD), shape)
    if key not in _MESH:
        _MESH.clear()
        _MESH[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESH[key]


def tiny_gpt(layers: int = 4):
    from pp_core_builtins.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=32, dim=16, num_layers=layers, num_heads=2, max_seq_len=16)


def dtensor_boundary_plan(sequence_parallel: bool) -> dict:
    """The built-in GPT plan, plus: every block returns a DTensor (sequence shards with
    sequence parallelism, else replicated) and takes a DTensor or a local tensor, so DTensors
    cross the stage boundaries."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput

    from pp_core_builtins.models.tp_plan import gpt_plan
    from pp_core_builtins.models.gpt import GPT

    between = Shard(1) if sequence_parallel else Replicate()
    plan = gpt_plan(GPT.__new__(GPT), sequence_parallel)
    plan["layers.*"] = PrepareModuleInputOutput(
        input_layouts=between, desired_input_layouts=between, use_local_input=True,
        output_layouts=between, desired_output_layouts=between, use_local_output=False)
    if not sequence_parallel:  # a plain LayerNorm takes the local (replicated) tensor
        plan["norm"] = PrepareModuleInput(input_layouts=between, desired_input_layouts=between,
                                          use_local_output=True)
    return plan


def tp_case(schedule: str, sequence_parallel: bool = False, pool: bool = False,
            boundary: str = "local", num_microbatches: int = 4, steps: int = 1,
            count: bool = False) -> dict:
    """``steps`` steps of pp2 x tp2 on the demo GPT; the last one vs one process.

    ``boundary``: ``local`` (the built-in plan: blocks return local tensors) or ``dtensor``
    (blocks return DTensors, which cross the stages as local shards plus placements).
    ``count``: count the collectives of the step with torch's ``CommDebugMode``.
    """
    from pp_core.parallel import apply_tensor_parallel

    mesh = pp_tp_mesh()
    layers = 4 if schedule not in ("interleaved_1f1b", "looped_bfs", "dfs", "zb_h2",
                                   "v_schedule", "v_half", "v_min", "dualpipe_v") else 4
    model = tiny_gpt(layers)
    ref_model = copy.deepcopy(model)
    local = 2 * num_microbatches
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=local, pp_microbatch_size=2,
                            loss_fn="cross_entropy", scale_grads_in_schedule=True,
                            pp_recv_buffer_pool=pool, pp_seq_len=8 if pool else None)
    pipe = build_pipeline(model, config, pp_group=mesh["pp"])
    plan = dtensor_boundary_plan(sequence_parallel) if boundary == "dtensor" else None
    modules = apply_tensor_parallel(pipe.model_parts, mesh["tp"], plan=plan,
                                    sequence_parallel=sequence_parallel)
    counts = None
    for step in range(steps):
        for part in pipe.model_parts:
            part.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)
        inputs, target = batch("gpt", local, seed=step + 1)
        if count:
            from torch.distributed.tensor.debug import CommDebugMode

            with CommDebugMode() as comm:
                loss = pipe.step(inputs, target=target)
            counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
        else:
            loss = pipe.step(inputs, target=target)
        ref_loss = reference(ref_model, resolve_loss("cross_entropy"), inputs, target,
                             num_microbatches, scale=True)
    ref_params = dict(ref_model.named_parameters())
    grad_err, names, placements = 0.0, [], set()
    for part in pipe.model_parts:
        for name, param in part.named_parameters():
            grad = param.grad
            if hasattr(grad, "full_tensor"):
                placements.add(str(grad.placements))
                grad = grad.full_tensor()
            want = ref_params[name].grad
            grad_err = max(grad_err, ((grad - want).abs().max() / (want.abs().max() + 1e-6)).item())
            names.append(name)
    loss_err = None if loss is None else abs(float(loss) - ref_loss) / abs(ref_loss)
    return {"loss_err": loss_err, "grad_err": grad_err, "names": names, "modules": modules,
            "stages": pipe.stage_indices, "counts": counts, "placements": sorted(placements),
            "tp_rank": mesh["tp"].get_local_rank()}
