"""Peak memory of building one rank's model parts, for a model much larger than a stage.

Run by hand: ``python benchmarks/split_memory.py [--dim 1536] [--depth 32] [--stages 8]``.
Prints one JSON line per case, then a table. Peak resident memory is read from
``/proc/self/status`` (VmHWM, reset through ``/proc/self/clear_refs``), because torch's CPU
allocations are invisible to tracemalloc; tracemalloc still reports the Python-object overhead.

Cases (each measures only the build, with the model already in memory or on meta):
- ``prune``: pp-core's ``build_model_parts`` for the first stage of a materialised model;
- ``deepcopy``: the usual alternative (NeMo AutoModel, torchtitan): deepcopy the model, then
  delete the other stages' modules;
- ``meta``: a model built on the meta device, one stage materialised on CPU by
  ``build_model_parts(..., device="cpu")``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import tracemalloc

import torch
from torch import nn

from _common import proc_status, reset_peak
from pp_core import PipelineConfig
from pp_core.planning.parts import build_model_parts, prune_model
from pp_core.planning.split import plan_split
from pp_core.testing import plugins_with

MIB = 1024 * 1024


class Model(nn.Module):
    def __init__(self, dim, depth, vocab=1024):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def _measure(build):
    gc.collect()
    before = proc_status("VmRSS")
    reset_peak()
    tracemalloc.start()
    result = build()
    _, python_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    peak = proc_status("VmHWM")
    return result, (peak - before) / MIB, python_peak / MIB


def _bytes(module) -> float:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values()) / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--stages", type=int, default=8)
    args = parser.parse_args()
    config, plugins = PipelineConfig(), plugins_with("pp_core_builtins.splitters.layers")

    with torch.device("meta"):
        model = Model(args.dim, args.depth)
    plan = plan_split(model, config, args.stages, 1, plugins)
    parts, peak, python_peak = _measure(
        lambda: build_model_parts(model, plan, [0], config, device="cpu"))
    rows = [dict(case="meta", model_mib=_bytes(model), stage_mib=_bytes(parts[0]),
                 peak_extra_rss_mib=peak, python_peak_mib=python_peak)]
    del parts, model

    model = Model(args.dim, args.depth).to_empty(device="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.fill_(0.01)  # touch every page so the model is resident
    stage = plan.fqns_per_stage[0]
    parts, peak, python_peak = _measure(lambda: build_model_parts(model, plan, [0], config))
    rows.append(dict(case="prune", model_mib=_bytes(model), stage_mib=_bytes(parts[0]),
                     peak_extra_rss_mib=peak, python_peak_mib=python_peak))
    del parts

    def deepcopy_then_prune():
        return prune_model(copy.deepcopy(model), stage)

    part, peak, python_peak = _measure(deepcopy_then_prune)
    rows.append(dict(case="deepcopy", model_mib=_bytes(model), stage_mib=_bytes(part),
                     peak_extra_rss_mib=peak, python_peak_mib=python_peak))

    for row in rows:
        print(json.dumps({key: round(v, 1) if isinstance(v, float) else v for key, v in row.items()}))
    print(f"\nmodel: dim={args.dim} depth={args.depth}, {args.stages} stages; building stage 0")
    print(f"{'case':10} {'model MiB':>10} {'stage MiB':>10} {'peak extra RSS MiB':>19} "
          f"{'python peak MiB':>16}")
    for row in rows:
        print(f"{row['case']:10} {row['model_mib']:10.1f} {row['stage_mib']:10.1f} "
              f"{row['peak_extra_rss_mib']:19.1f} {row['python_peak_mib']:16.2f}")


if __name__ == "__main__":
    main()
