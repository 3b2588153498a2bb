"""PP x torch data parallelism on 4 CPU ranks: per-rank bytes of parameters + gradients + AdamW
state, and step time, for pp2 alone (2 ranks, the whole global batch), pp2 x fsdp2,
pp2 x replicate2 (DDP semantics through FSDP's ``replicate``) and pp2 x ddp2 (torch's
``DistributedDataParallel`` with ``patch_stage_backward_maybe_with_nosync``), the demo GPT, 1f1b.
Run by hand:

    .venv/bin/python benchmarks/bench_fsdp.py [--steps 6] [--dim 256] [--layers 8]

Prints JSON (one line per layout) and a markdown table; writes benchmarks/results/bench_fsdp.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pp_core.testing.dist_pool import DistPool  # noqa: E402
from _common import options, write_json  # noqa: E402


def _local_bytes(tensor) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def measure(layout: str, steps: int, dim: int, layers: int, microbatches: int) -> dict:
    """One layout on this rank: bytes held and the median step time."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pp_core import PipelineConfig, build_pipeline
    from pp_core.parallel import apply_data_parallel
    from pp_core_builtins.models.gpt import GPT

    world = dist.get_world_size()
    dp = 1 if layout == "pp2" else 2
    if world != 2 * dp:
        return {}
    mesh = init_device_mesh("cpu", (2, dp), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = GPT(vocab_size=256, dim=dim, num_layers=layers, num_heads=4, max_seq_len=64)
    global_batch = 4 * microbatches
    local = global_batch // dp
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=local,
                            pp_microbatch_size=local // microbatches, loss_fn="cross_entropy",
                            scale_grads_in_schedule=True,
                            patch_stage_backward_maybe_with_nosync=layout == "pp2_ddp2")
    pipe = build_pipeline(model, config, pp_group=mesh["pp"])
    if layout == "pp2_ddp2":  # one all-reduce per stage and step, through no_sync
        from torch.nn.parallel import DistributedDataParallel

        for index, part in enumerate(pipe.model_parts):
            pipe.model_parts[index] = DistributedDataParallel(part,
                                                              process_group=mesh["dp"].get_group())
    elif layout != "pp2":
        apply_data_parallel(pipe, mesh["dp"], shard=layout == "pp2_fsdp2")
    params = list({id(p): p for part in pipe.model_parts for p in part.parameters()}.values())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    tokens = torch.randint(0, 256, (global_batch, 65), generator=torch.Generator().manual_seed(1))
    dp_rank = mesh["dp"].get_local_rank()
    inputs = tokens[dp_rank * local:(dp_rank + 1) * local]
    times = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        pipe.step(inputs[:, :-1], target=inputs[:, 1:])
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    held = sum(_local_bytes(p) + _local_bytes(p.grad) for p in params)
    held += sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    times = sorted(times[1:])  # the first step builds FSDP's lazy state
    return {"layout": layout, "rank": dist.get_rank(), "bytes": held,
            "step_s": times[len(times) // 2]}


def main() -> None:
    args = options(__doc__, steps=6, dim=256, layers=8, microbatches=4).parse_args()
    rows = []
    for world, layouts in ((2, ["pp2"]), (4, ["pp2_fsdp2", "pp2_replicate2", "pp2_ddp2"])):
        with DistPool(world, timeout=600) as pool:
            for layout in layouts:
                ranks = pool.run(measure, layout, args.steps, args.dim, args.layers,
                                 args.microbatches)
                row = {"layout": layout, "ranks": world,
                       "max_rank_bytes": max(r["bytes"] for r in ranks),
                       "step_s": max(r["step_s"] for r in ranks), **vars(args)}
                print(json.dumps(row))
                rows.append(row)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_fsdp.json")
    write_json(out, rows)
    print("\n| layout | ranks | params + grads + AdamW per rank (max) | step time (median) |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['layout']} | {row['ranks']} | {row['max_rank_bytes'] / 2**20:.2f} MiB | "
              f"{row['step_s'] * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
