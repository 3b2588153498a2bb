"""Mixture of experts with expert parallelism: ep 1 against ep 2 on 4 gloo ranks (pp 2 x dp 2).

``moe_gpt`` (vocab 256, dim 128, 4 blocks, 8 experts of hidden 256, top-2, a shared expert,
sequence 64), each dp rank's batch 8 in 4 microbatches, schedule ``1f1b`` unless ``--schedule``
says otherwise, each rank one thread. Per ep degree and rank:

* expert bytes: the bytes of the expert weights the rank holds (``pp_expert_parallel``
  parameters with ep > 1; the stacked ``experts.*`` weights with ep 1) - ep 2 halves them;
* step time: median over the measured steps (pipeline step, expert gradient sync, clipping),
  after warm-up steps;
* all-to-all share: over profiled steps (``torch.profiler``), the time inside the
  ``pp_core.moe.all_to_all`` records (the count exchange and the token all-to-alls, forward and
  backward) divided by the step time - measured from the trace, as the overlap work needs it.

    python benchmarks/bench_moe.py [--steps 6] [--schedule 1f1b] [--json out.json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import options, write_json  # noqa: E402

MODEL = dict(vocab_size=256, dim=128, num_layers=4, num_heads=4, max_seq_len=64,
             num_experts=8, top_k=2, moe_hidden=256, shared_expert=True)
LOCAL_BATCH, MICROBATCH, SEQ = 8, 2, 64
RECORD = "pp_core.moe.all_to_all"


def rank_run(ep: int, schedule: str, steps: int, warmup: int) -> dict:
    """One rank of pp 2 x dp 2: steps of moe_gpt with ep ``ep``; its figures."""
    import torch.distributed as dist

    from pp_core import PipelineConfig, build_pipeline
    from pp_core.parallel import ParallelSettings, parallelize
    from pp_core.parallel.dims import ParallelDims
    from pp_core.parallel.expert import is_expert_parameter
    from pp_core.parallel.gradients import clip_grad_norm
    from pp_core_builtins.models.moe_gpt import MoEGPT

    torch.set_num_threads(1)
    meshes = ParallelDims(pp=2, dp_shard=2, ep=ep).build("cpu")  # the mesh and the ep groups
    torch.manual_seed(0)
    model = MoEGPT(**MODEL)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=LOCAL_BATCH,
                            pp_microbatch_size=MICROBATCH, loss_fn="cross_entropy",
                            scale_grads_in_schedule=True)
    pipe = build_pipeline(model, config, meshes=meshes)
    parallelize(pipe, meshes, ParallelSettings(data_parallel="replicate"))
    params = [p for part in pipe.model_parts for p in part.parameters()]
    experts = [p for part in pipe.model_parts for n, p in part.named_parameters()
               if is_expert_parameter(p) or ".experts." in n]
    expert_bytes = sum(p.numel() * p.element_size() for p in experts)
    generator = torch.Generator().manual_seed(dist.get_rank() % 2)

    def step():
        tokens = torch.randint(0, MODEL["vocab_size"], (LOCAL_BATCH, SEQ + 1),
                               generator=generator)
        for param in params:
            param.grad = None
        start = time.perf_counter()
        pipe.step(tokens[:, :-1], target=tokens[:, 1:])  # expert gradients averaged inside
        clip_grad_norm(params, 1.0, meshes.pp.get_group(), ep_group=meshes.ep_group)
        return time.perf_counter() - start

    for _ in range(warmup):
        step()
    times = [step() for _ in range(steps)]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = [step() for _ in range(2)]
    inside = sum(e.cpu_time_total for e in prof.key_averages() if e.key == RECORD) / 1e6
    return {"rank": dist.get_rank(), "ep": ep, "expert_bytes": expert_bytes,
            "step_time_s": statistics.median(times),
            "all_to_all_share": inside / sum(profiled) if ep > 1 else 0.0}


def main() -> None:
    from pp_core.testing import DistPool

    args = options(__doc__, steps=6, warmup=2, schedule="1f1b", json=None).parse_args()
    rows = []
    with DistPool(4, timeout=900) as pool:
        for ep in (1, 2):
            rows += pool.run(rank_run, ep, args.schedule, args.steps, args.warmup)
    print(json.dumps(rows, indent=1))
    print(f"\nmoe_gpt {MODEL}, schedule {args.schedule}, pp 2 x dp 2, batch {LOCAL_BATCH} per "
          f"dp rank, microbatch {MICROBATCH}, seq {SEQ}")
    print(f"{'ep':>3} {'rank':>5} {'expert MiB':>11} {'step ms':>9} {'all-to-all':>11}")
    for row in rows:
        print(f"{row['ep']:>3} {row['rank']:>5} {row['expert_bytes'] / 2**20:>11.2f} "
              f"{row['step_time_s'] * 1e3:>9.1f} {row['all_to_all_share']:>10.1%}")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
