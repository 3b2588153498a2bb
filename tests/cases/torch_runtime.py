"""What tests/runtime/test_torch_runtime_csv.py runs on every rank, and torch's schedule objects built
without processes.

:func:`torch_runtime_case` runs a compute_comms CSV in torch's own ``_PipelineScheduleRuntime``
(real ``PipelineStage``s over the pool's gloo group) and compares the loss and every gradient
with the unsplit model on this process, as :func:`_runtime_cases.train_case` does for pp-core.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from unittest import mock

import torch
from torch import nn

from tests.cases.compare import UNIT, grad_difference, reference_grads
from tests.cases.runtime import batch, mlp, mse, reference

LAYERS = 8


def torch_schedule(cls, num_ranks: int, num_microbatches: int, stages_per_rank: int, **kwargs):
    """A torch schedule object on stand-in stages, as torch's own visualizer builds one
    (``_schedule_visualizer.get_schedule_ops``): only its program is used, no step runs."""
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, num_ranks, None
    stage.num_stages = num_ranks * stages_per_rank
    stages = [stage] * stages_per_rank
    return cls(stages if stages_per_rank > 1 or not _single(cls) else stage, num_microbatches,
               **kwargs)


def _single(cls) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return issubclass(cls, PipelineScheduleSingle)


def torch_comms_dump(cls_name: str, num_ranks: int, num_microbatches: int, path) -> None:
    """torch's compute_comms dump (``_dump_csv`` of the lowered program) of schedule class
    ``cls_name``; the single-stage classes (GPipe, 1F1B) lowered by ``_PipelineScheduleRuntime``
    from their pipeline order, as a runtime schedule would."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, cls_name)
    if _single(cls):
        order = torch_schedule(cls, num_ranks, num_microbatches, 1)._get_pipeline_order()
        order = {rank: [a for a in row if a is None or a.is_compute_op]  # 2.13's has REDUCE_GRAD
                 for rank, row in order.items()}
        runtime = torch_schedule(schedules._PipelineScheduleRuntime, num_ranks,
                                 num_microbatches, 1)
        runtime._prepare_schedule_with_comms(order)
    else:
        runtime = torch_schedule(cls, num_ranks, num_microbatches, 2)
    runtime._dump_csv(str(path), format="compute_comms")


def torch_runtime_case(csv_text: str, num_microbatches: int, scale: bool = False) -> dict:
    """One step of ``csv_text`` (compute_comms) in torch's ``_PipelineScheduleRuntime`` on this
    pool's ranks; the loss and gradient differences against the unsplit model."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from pp_core.schedule.csv_io import parse_csv

    rank = dist.get_rank()
    schedule = parse_csv(csv_text)
    num_stages = schedule.num_stages
    per = LAYERS // num_stages
    model = mlp(LAYERS)
    ref_model = copy.deepcopy(model)
    mine = [s for s in range(num_stages) if schedule.stage_ranks[s] == rank]
    stages = [PipelineStage(nn.Sequential(OrderedDict(
                  (str(i), model[i]) for i in range(s * per, (s + 1) * per))),
                  s, num_stages, torch.device("cpu")) for s in mine]
    runtime = _PipelineScheduleRuntime(stages, n_microbatches=num_microbatches, loss_fn=mse,
                                       scale_grads=scale)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                        f"pp_core_torch_rt_{os.getpid()}_{rank}.csv")
    with open(path, "w", newline="") as handle:
        handle.write(csv_text)
    try:
        runtime._load_csv(path, format="compute_comms")
    finally:
        os.remove(path)
    inputs, target = batch("mlp", 2 * num_microbatches)
    last = num_stages - 1 in mine
    losses: list = []
    args = (inputs,) if 0 in mine else ()
    runtime.step(*args, target=target if last else None, losses=losses if last else None,
                 return_outputs=False)
    ref_loss = reference(ref_model, mse, inputs, target, num_microbatches, scale)
    grad_err, names, missing, _ = grad_difference([stage.submod for stage in stages],
                                                  reference_grads(ref_model), scale=UNIT)
    loss = torch.stack(losses).mean().item() if last else None
    return {"grad_err": grad_err, "loss_err": None if loss is None else abs(loss - ref_loss),
            "names": names, "missing": missing, "stages": tuple(mine)}
