"""Tensor parallel inside a stage: what each rank holds, pp2 against pp2 x tp2, on the demo GPT.

Per rank: bytes of parameters + gradients + AdamW state (``exp_avg``, ``exp_avg_sq``) after a
step (local shards of DTensors), the peak bytes of the activations autograd saves for backward
during a step (every tensor the graph saves, counted once per storage while it is alive, through
``torch.autograd.graph.saved_tensors_hooks``; parameters excluded), and the median step time.
Layouts: pp2 (2 ranks), pp2 x tp2 and pp2 x tp2 with sequence parallelism (4 ranks); the same
global batch, 1f1b, gloo on CPU. Run by hand:

    .venv/bin/python benchmarks/bench_tp.py [--steps 5] [--dim 128] [--layers 4]

Prints JSON (one line per layout) and a markdown table with the ratios to pp2; writes
benchmarks/results/bench_tp.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "plugins"))

from pp_core.testing.dist_pool import DistPool  # noqa: E402
from _common import options, write_json  # noqa: E402

LAYOUTS = {"pp2": (2, False), "pp2_tp2": (4, False), "pp2_tp2_sp": (4, True)}


def _local(tensor):
    return getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank


def _bytes(tensor) -> int:
    if tensor is None:
        return 0
    local = _local(tensor)
    return local.numel() * local.element_size()


class SavedBytes:
    """The bytes of the storages autograd holds for backward, now and at most."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.live, self.now, self.peak = exclude, {}, 0, 0

    def hooks(self):
        import torch

        meter = self

        class Held:
            def __init__(self, tensor):
                self.tensor = tensor
                storage = _local(tensor).untyped_storage()
                self.key = storage.data_ptr()
                if self.key in meter.exclude:
                    self.key = None
                    return
                count, size = meter.live.get(self.key, (0, storage.nbytes()))
                if count == 0:
                    meter.now += size
                    meter.peak = max(meter.peak, meter.now)
                meter.live[self.key] = (count + 1, size)

            def __del__(self):
                if self.key is None:
                    return
                count, size = meter.live[self.key]
                if count == 1:
                    del meter.live[self.key]
                    meter.now -= size
                else:
                    meter.live[self.key] = (count - 1, size)

        return torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.tensor)


def measure(layout: str, steps: int, dim: int, layers: int, microbatches: int) -> dict:
    """One layout on this rank: bytes held, peak saved activations, median step time."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pp_core import PipelineConfig, build_pipeline
    from pp_core.parallel import apply_tensor_parallel
    from pp_core_builtins.models.gpt import GPT

    world, sequence_parallel = LAYOUTS[layout]
    if dist.get_world_size() != world:
        return {}
    tp = world // 2
    mesh = init_device_mesh("cpu", (2, tp), mesh_dim_names=("pp", "tp"))
    torch.manual_seed(0)
    model = GPT(vocab_size=256, dim=dim, num_layers=layers, num_heads=4, max_seq_len=64)
    batch = 4 * microbatches
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=batch, pp_microbatch_size=4,
                            loss_fn="cross_entropy", scale_grads_in_schedule=True)
    pipe = build_pipeline(model, config, pp_group=mesh["pp"])
    if tp > 1:
        apply_tensor_parallel(pipe.model_parts, mesh["tp"], sequence_parallel=sequence_parallel)
    params = list({id(p): p for part in pipe.model_parts for p in part.parameters()}.values())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    tokens = torch.randint(0, 256, (batch, 65), generator=torch.Generator().manual_seed(1))
    meter = SavedBytes({_local(p).untyped_storage().data_ptr() for p in params})
    times = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        with meter.hooks():
            pipe.step(tokens[:, :-1], target=tokens[:, 1:])
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    held = sum(_bytes(p) + _bytes(p.grad) for p in params)
    held += sum(_bytes(v) for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    times = sorted(times[1:])  # the first step warms up
    return {"rank": dist.get_rank(), "bytes": held, "activations": meter.peak,
            "left": meter.now, "step_s": times[len(times) // 2]}


def main() -> None:
    args = options(__doc__, steps=5, dim=128, layers=4, microbatches=4).parse_args()
    rows = []
    for world in (2, 4):
        with DistPool(world, timeout=600) as pool:
            for layout in [name for name, (w, _) in LAYOUTS.items() if w == world]:
                ranks = pool.run(measure, layout, args.steps, args.dim, args.layers,
                                 args.microbatches)
                row = {"layout": layout, "ranks": world,
                       "max_rank_bytes": max(r["bytes"] for r in ranks),
                       "max_rank_activations": max(r["activations"] for r in ranks),
                       "activations_left": max(r["left"] for r in ranks),
                       "step_s": max(r["step_s"] for r in ranks), **vars(args)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_tp.json")
    write_json(out, rows)
    base = rows[0]
    print("\n| layout | ranks | params + grads + AdamW per rank (max) | ratio | peak saved "
          "activations per rank (max) | ratio | step time (median) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['layout']} | {row['ranks']} | {row['max_rank_bytes'] / 2**20:.3f} MiB | "
              f"{row['max_rank_bytes'] / base['max_rank_bytes']:.3f} | "
              f"{row['max_rank_activations'] / 2**20:.3f} MiB | "
              f"{row['max_rank_activations'] / base['max_rank_activations']:.3f} | "
              f"{row['step_s'] * 1e3:.0f} ms | {row['step_s'] / base['step_s']:.2f} |")


if __name__ == "__main__":
    main()
