"""What the tensor-parallel checkpoint tests run: the demo GPT at pp2 x tp2 (4 gloo ranks) saves
a DCP checkpoint of its DTensor parameters and AdamW moments (the fused ``qkv`` a
``_StridedShard``), and continues from it at pp2 x tp1 (the 4 ranks as two independent pp2
pipelines, each running the whole global batch). Module-level functions, picklable results.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pp_core import PipelineConfig, build_pipeline
from pp_core.checkpoint import load_checkpoint, save_checkpoint
from tests.cases.dcp import GLOBAL_BATCH, LAYERS, _optimizers, full_state
from tests.cases.runtime import batch, gpt


def _pipeline(tp: int):
    """This rank's parts at pp2 x ``tp`` on 4 ranks (tp 1: two copies of a pp2 pipeline, pp
    innermost) and its pp mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from pp_core.parallel import apply_tensor_parallel

    names = ("pp", "tp") if tp > 1 else ("copy", "pp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=GLOBAL_BATCH, pp_microbatch_size=1,
                            loss_fn="cross_entropy", scale_grads_in_schedule=True)
    pipe = build_pipeline(gpt(LAYERS), config, pp_group=mesh["pp"])
    if tp > 1:
        apply_tensor_parallel(pipe.model_parts, mesh["tp"])
    return pipe, mesh["pp"]


def _steps(pipe, pp_mesh, optimizers, first: int, last: int) -> list[float]:
    """Steps ``first..last`` on the whole global batch (seed = step); the loss of each, on
    every rank of the pipeline (sent from the last stage)."""
    group = pp_mesh.get_group()
    last_rank = dist.get_global_rank(group, pp_mesh.size() - 1)
    losses = []
    for step in range(first, last + 1):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        inputs, target = batch("gpt", GLOBAL_BATCH, seed=step)
        loss = pipe.step(inputs, target=target)
        for optimizer in optimizers:
            optimizer.step()
        value = torch.tensor([0.0 if loss is None else float(loss)], dtype=torch.float64)
        dist.broadcast(value, src=last_rank, group=group)
        losses.append(float(value))
    return losses


def train_and_save(directory: str, save_at: int, steps: int) -> dict:
    """pp2 x tp2 for ``steps`` steps, saving after ``save_at``: losses, whole weights and
    moments as saved, and the placements of the sharded parameters."""
    pipe, pp_mesh = _pipeline(2)
    optimizers = _optimizers(pipe.model_parts)
    losses = _steps(pipe, pp_mesh, optimizers, 1, save_at)
    save_checkpoint(directory, save_at, pipe.model_parts, optimizers)
    saved = full_state(pipe.model_parts, optimizers)
    placements = {name: str(p.placements) for part in pipe.model_parts
                  for name, p in part.named_parameters() if hasattr(p, "placements")}
    return {"losses": losses + _steps(pipe, pp_mesh, optimizers, save_at + 1, steps),
            "saved": saved, "placements": placements}


def resume(path: str, steps: int, tp: int = 1) -> dict:
    """Load ``path`` at pp2 x ``tp`` and train on to ``steps``: losses, whole state loaded."""
    pipe, pp_mesh = _pipeline(tp)
    optimizers = _optimizers(pipe.model_parts)
    start = load_checkpoint(path, pipe.model_parts, optimizers, process_group=pp_mesh.get_group())
    loaded = full_state(pipe.model_parts, optimizers)
    return {"losses": _steps(pipe, pp_mesh, optimizers, start + 1, steps), "loaded": loaded}
