"""What the checkpoint-across-layouts tests run: train the demo GPT with pp x FSDP2 on DistPool
ranks, save a DCP checkpoint of the sharded parts, and continue from it at another layout (pp4
unsharded, or one process on the unsplit model). Module-level functions, picklable results.

Every layout steps on the same global batches with ``scale_grads_in_schedule=True`` and AdamW,
so the losses of a resumed run must equal those of the run that never stopped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pp_core import PipelineConfig, build_pipeline
from pp_core.checkpoint import load_checkpoint, save_checkpoint
from pp_core.losses import resolve_loss
from tests.cases.fsdp import dp_rank_and_size
from tests.cases.runtime import batch, gpt

GLOBAL_BATCH = 8
LAYERS = 4
LR = 0.01


def _optimizers(parts):
    return [torch.optim.AdamW(part.parameters(), lr=LR) for part in parts]


def _pipeline(layout: tuple[int, int, int], schedule: str):
    """This rank's parts of the demo GPT at ``layout = (pp, dp_replicate, dp_shard)`` (the mesh
    ``pp-core run`` builds; ``apply_data_parallel`` when there is data parallelism) and the dp
    mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", layout, mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    local = GLOBAL_BATCH // dp_mesh.size()
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=local, pp_microbatch_size=1,
                            loss_fn="cross_entropy", scale_grads_in_schedule=True)
    pipe = build_pipeline(gpt(LAYERS), config, pp_group=mesh["pp"])
    if dp_mesh.size() > 1:
        from pp_core.parallel import apply_data_parallel

        apply_data_parallel(pipe, dp_mesh if layout[1] > 1 else mesh["dp_shard"])
    return pipe, dp_mesh


def _steps(pipe, dp_mesh, optimizers, first: int, last: int) -> list[float | None]:
    """Steps ``first..last`` (batch seed = step); the global mean loss of each (on every rank)."""
    dp_rank, dp = dp_rank_and_size(dp_mesh)
    share = GLOBAL_BATCH // dp
    losses = []
    for step in range(first, last + 1):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        inputs, target = batch("gpt", GLOBAL_BATCH, seed=step)
        mine = slice(dp_rank * share, (dp_rank + 1) * share)
        loss = pipe.step(inputs[mine], target=target[mine])
        for optimizer in optimizers:
            optimizer.step()
        total = torch.tensor([0.0 if loss is None else float(loss), float(loss is not None)],
                             dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(float(total[0] / total[1]))
    return losses


def full_state(parts, optimizers) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW moment of these parts, whole (``full_tensor`` of a shard):
    ``{name: weight}`` and ``{name.exp_avg / name.exp_avg_sq: moment}`` (collective over dp)."""
    def whole(tensor):
        tensor = tensor.detach()
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()

    state = {}
    for part, optimizer in zip(parts, optimizers):
        for name, param in part.named_parameters():
            state[name] = whole(param)
            for slot in ("exp_avg", "exp_avg_sq"):
                if slot in optimizer.state.get(param, {}):
                    state[f"{name}.{slot}"] = whole(optimizer.state[param][slot])
    return state


def train_and_save(directory: str, layout: tuple, save_at: int, steps: int,
                   schedule: str = "1f1b") -> dict:
    """Train ``steps`` steps at ``layout`` (pp, dp_replicate, dp_shard), saving a checkpoint after step ``save_at``; the losses
    and this rank's whole weights and moments as saved."""
    pipe, dp_mesh = _pipeline(layout, schedule)
    optimizers = _optimizers(pipe.model_parts)
    losses = _steps(pipe, dp_mesh, optimizers, 1, save_at)
    save_checkpoint(directory, save_at, pipe.model_parts, optimizers)
    saved = full_state(pipe.model_parts, optimizers)
    return {"losses": losses + _steps(pipe, dp_mesh, optimizers, save_at + 1, steps),
            "saved": saved}


def resume(path: str, layout: tuple, steps: int, schedule: str = "1f1b") -> dict:
    """Load ``path`` at ``layout`` and train on to step ``steps``; the losses and the whole
    weights and moments as loaded."""
    pipe, dp_mesh = _pipeline(layout, schedule)
    optimizers = _optimizers(pipe.model_parts)
    start = load_checkpoint(path, pipe.model_parts, optimizers)
    loaded = full_state(pipe.model_parts, optimizers)
    return {"losses": _steps(pipe, dp_mesh, optimizers, start + 1, steps), "loaded": loaded}


def resume_unsplit(path: str, steps: int) -> dict:
    """Load ``path`` into the unsplit model on one process and train on to step ``steps``: the
    mean microbatch loss over the global batch, its gradient, AdamW."""
    model = gpt(LAYERS)
    (optimizer,) = _optimizers([model])
    start = load_checkpoint(path, [model], [optimizer])
    loaded = full_state([model], [optimizer])
    loss_fn = resolve_loss("cross_entropy")
    losses = []
    for step in range(start + 1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        inputs, target = batch("gpt", GLOBAL_BATCH, seed=step)
        total = 0.0
        for x, y in zip(inputs.split(1), target.split(1)):
            loss = loss_fn(model(x), y)
            (loss / GLOBAL_BATCH).backward()
            total += loss.item()
        optimizer.step()
        losses.append(total / GLOBAL_BATCH)
    return {"losses": losses, "loaded": loaded}


# ----------------------------------------------------------------------------- in the test process


def merged(results: list[dict]) -> dict:
    """:func:`train_and_save`'s results by rank as ``{losses, saved}``: each pp rank's whole
    weights and moments (its dp peers hold the same)."""
    saved = {}
    for result in results:
        saved.update(result["saved"])
    return {"losses": results[0]["losses"], "saved": saved}


def check_resumed(results: list[dict], first: dict, save_at: int, atol: float = 1e-5) -> None:
    """A resumed run (results by rank) loaded every weight and moment ``first`` (see
    :func:`merged`) saved, bit for bit, and continued with its losses."""
    expected = first["losses"][save_at:]
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected),
                                   rtol=0, atol=atol, msg=lambda m: f"rank {rank}: {m}")
        for name, value in result["loaded"].items():
            assert torch.equal(value, first["saved"][name]), f"rank {rank}: {name}"
    loaded = {name for result in results for name in result["loaded"]}
    assert loaded == set(first["saved"]), "the layouts cover the same weights and moments"
