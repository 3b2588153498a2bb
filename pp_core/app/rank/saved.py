"""``peak_saved_bytes`` of every rank, for the metrics record and the summary (issue 47).

Each rank measures its own (:class:`pp_core.runtime.saved_bytes.SavedBytes`); one all-gather of
an int64 per step gives every rank the list, so the metrics line (written by the first rank)
carries the worst rank's and the summary each rank's most over the run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_saved_peaks"]


def gather_saved_peaks(pipe, device) -> list[int]:
    """The last step's ``peak_saved_bytes`` of every rank, in rank order (a collective)."""
    mine = int(getattr(getattr(pipe, "saved_bytes", None), "peak", 0))
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    backend = dist.get_backend()
    where = torch.device("cpu") if backend == "gloo" else torch.device(device)
    value = torch.tensor([mine], dtype=torch.int64, device=where)
    out = [torch.zeros_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(out, value)
    return [int(t.item()) for t in out]
