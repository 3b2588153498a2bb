"""``peak_saved_bytes`` of every rank, for the metrics record and the summary (issue 47).

Each rank measures its own (:class:`pp_core.runtime.saved_bytes.SavedBytes`) and keeps its most
over the run, which the summary gathers with the rank's other figures; on a logged step one
all-gather of an int64 gives the first rank, which writes the metrics line, the worst rank's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_saved_peaks"]


def gather_saved_peaks(mine: int, device) -> list[int]:
    """Every rank's ``mine`` (a step's ``peak_saved_bytes``), in rank order (a collective)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    backend = dist.get_backend()
    where = torch.device("cpu") if backend == "gloo" else torch.device(device)
    value = torch.tensor([mine], dtype=torch.int64, device=where)
    out = [torch.zeros_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(out, value)
    return [int(t.item()) for t in out]
