"""FSDP2 x TP inside a pipeline on 8 CPU ranks: pp2 x dp_shard2 x tp2, the mesh ``pp-core run``
builds (tp innermost). Each stage's parts are sharded over ``mesh["tp"]`` with
``apply_tensor_parallel`` (the demo GPT's built-in plan, fused ``qkv`` a strided shard), then
over ``mesh["dp_shard"]`` with ``apply_data_parallel`` (FSDP2: parameters become DTensors on the
2-D (dp_shard, tp) mesh). Not a pytest test: 8 gloo ranks on a 2-core machine are over the
suite's budget; run by hand:

    .venv/bin/python benchmarks/check_fsdp_tp.py [schedule ...]   (default: 1f1b)

For each schedule: one step on a global batch of 8 (each dp rank 4, microbatches of 1) against
the unsplit model on one process; the loss (mean over the dp ranks of the last stage) and every
gradient (``full_tensor()``), relative to 1e-5. Prints JSON and a table; exits 1 on a failure.

The fused ``qkv`` weight is a strided shard on tp (``_StridedShard(0, sf=3)``, rank r holds
``[q_r; k_r; v_r]``) that FSDP2 shards again along rows over dp (``_StridedShard(0, sf=2)``);
torch 2.13's ``full_tensor()`` of that nested placement puts the rows in the wrong order (the
table's last column), so its gradient is assembled from the local shards by hand
(:func:`strided_whole`) and compared that way; that is the number the check counts.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "plugins"), os.path.join(ROOT, "tests")]

from pp_core.testing import DistPool  # noqa: E402

RTOL = 1e-5
GLOBAL_BATCH = 8


def strided_whole(locals_: dict, chunks: int):
    """The whole fused weight from its local pieces ``{(dp, tp): rows}``: FSDP2 splits each tp
    rank's ``[q_r; k_r; v_r]`` along rows over dp; the whole is ``[q_0; q_1; k_0; ...]``."""
    import torch

    dps = 1 + max(d for d, _ in locals_)
    tps = 1 + max(t for _, t in locals_)
    per_tp = [torch.cat([locals_[(d, t)] for d in range(dps)]) for t in range(tps)]
    return torch.cat([piece for j in range(chunks) for piece in
                      (rows.chunk(chunks)[j] for rows in per_tp)])


def case(schedule: str) -> dict:
    """This rank's loss and worst relative gradient error against one process."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pp_core import PipelineConfig, build_pipeline
    from pp_core.losses import resolve_loss
    from pp_core.parallel import apply_data_parallel, apply_tensor_parallel
    from tests._runtime_cases import batch, gpt, reference

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
    model = gpt(4)
    ref_model = copy.deepcopy(model)
    local = GLOBAL_BATCH // 2
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=local, pp_microbatch_size=1,
                            loss_fn="cross_entropy", scale_grads_in_schedule=True)
    pipe = build_pipeline(model, config, pp_group=mesh["pp"])
    modules = apply_tensor_parallel(pipe.model_parts, mesh["tp"])
    units = apply_data_parallel(pipe, mesh["dp_shard"])
    inputs, target = batch("gpt", GLOBAL_BATCH, seed=1)
    dp_rank = mesh["dp_shard"].get_local_rank()
    mine = slice(dp_rank * local, (dp_rank + 1) * local)
    loss = pipe.step(inputs[mine], target=target[mine])
    ref_loss = reference(ref_model, resolve_loss("cross_entropy"), inputs, target, GLOBAL_BATCH,
                         scale=True)
    ref_params = dict(ref_model.named_parameters())
    grad_err, names, placements, wrong = 0.0, [], set(), {}
    for part in pipe.model_parts:
        for name, param in part.named_parameters():
            grad = param.grad
            placements.add(str(getattr(grad, "placements", None)))
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            want = ref_params[name].grad
            err = ((grad - want).abs().max() / (want.abs().max() + 1e-6)).item()
            if not name.endswith("qkv.weight"):  # full_tensor() misplaces its rows: by hand
                grad_err = max(grad_err, err)
            names.append(name)
            if err > RTOL:
                wrong[name] = (err, str(getattr(param.grad, "placements", None)))
    # the fused qkv's gradient, assembled from the local shards by hand (see strided_whole)
    qkv = [(n, p) for part in pipe.model_parts for n, p in part.named_parameters()
           if n.endswith("qkv.weight")]
    manual_err = 0.0
    for name, param in qkv:
        coords = (mesh["pp"].get_local_rank(), dp_rank, mesh["tp"].get_local_rank())
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, (coords, name, param.grad.to_local().detach()))
        want = ref_params[name].grad
        whole = strided_whole({c[1:]: t for c, n, t in pieces if n == name}, 3)
        manual_err = max(manual_err, ((whole - want).abs().max()
                                      / (want.abs().max() + 1e-6)).item())
    return {"loss": None if loss is None else float(loss), "ref_loss": ref_loss,
            "manual_qkv_err": manual_err,
            "grad_err": grad_err, "names": names, "modules": modules, "units": units,
            "placements": sorted(placements), "wrong": wrong}


def check(pool, schedule: str) -> dict:
    results = pool.run(case, schedule)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    ref = results[0]["ref_loss"]
    # the last stage's 4 ranks: 2 dp ranks x 2 tp ranks, each the mean of its dp rank's batch
    loss_err = abs(sum(losses) / len(losses) - ref) / abs(ref) if len(losses) == 4 else None
    grad_err = max(max(r["grad_err"] for r in results),
                   max(r["manual_qkv_err"] for r in results))
    covered = {n for r in results for n in r["names"]}
    ok = (loss_err is not None and loss_err <= RTOL and grad_err <= RTOL
          and len(covered) == 4 * 8 + 5 and all(r["modules"] and r["units"] for r in results))
    return {"check": f"pp2 x dp_shard2 x tp2 {schedule}", "loss_err": loss_err,
            "grad_err": grad_err, "params": len(covered),
            "placements": sorted({p for r in results for p in r["placements"]}),
            "wrong": {n: w for r in results for n, w in r["wrong"].items()},
            "manual_qkv_err": max(r["manual_qkv_err"] for r in results), "ok": ok}


def main() -> int:
    schedules = sys.argv[1:] or ["1f1b"]
    started = time.perf_counter()
    with DistPool(8, timeout=600) as pool:
        rows = [check(pool, schedule) for schedule in schedules]
    for row in rows:
        print(json.dumps(row))
    print("\n| check | loss rel err | max grad rel err | qkv full_tensor() rel err | ok |\n"
          "|---|---|---|---|---|")
    for row in rows:
        loss = "-" if row["loss_err"] is None else f"{row['loss_err']:.1e}"
        qkv = max([w[0] for w in row["wrong"].values()] or [0.0])
        print(f"| {row['check']} | {loss} | {row['grad_err']:.1e} | {qkv:.1e} | {row['ok']} |")
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
