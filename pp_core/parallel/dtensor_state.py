"""Strided DTensor shards in a state dict that DCP writes and reads.

A ``_StridedShard`` (the fused ``qkv`` projection's column-wise shard: tp rank r holds the r-th
rows of q, of k and of v) is not one contiguous block of the whole tensor, but DCP describes
each rank's piece of a DTensor as one chunk (an offset and a size): it would record overlapping
chunks and refuse to save (``overlapping chunks``), or misplace rows. So before DCP sees a state
dict, each such DTensor is redistributed with its strided dimensions replicated (a whole
tensor along them on every rank, transiently: one fused weight or moment at a time in memory);
after a load, the whole tensor goes back to the layout the parameter has. The file is then the
same as that of any other layout, and loads at any tp size (or into the unsplit model).
"""

from __future__ import annotations

__all__ = ["unstride", "restride"]


def _is_strided(value) -> bool:
    """A DTensor strided-sharded on one mesh dimension and replicated on the others (tensor
    parallelism's fused projections). Combined with another shard (FSDP2 x TP: a tp strided
    shard sharded again over dp) it is left to DCP as it is: unproven here (torch's own
    ``full_tensor()`` misorders such a tensor's rows; benchmarks/check_fsdp_tp.py)."""
    from torch.distributed.tensor import Replicate  # lazy: torch.distributed
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = getattr(value, "placements", ())
    return (sum(isinstance(p, _StridedShard) for p in placements) == 1
            and all(isinstance(p, (_StridedShard, Replicate)) for p in placements))


def unstride(state: dict) -> dict:
    """``state`` (nested dicts) with every ``_StridedShard`` DTensor replicated along its
    strided mesh dimensions; returns ``{path: (mesh, placements)}`` of those it changed, for
    :func:`restride`."""
    from torch.distributed.tensor import Replicate  # lazy: torch.distributed
    from torch.distributed.tensor.placement_types import _StridedShard

    changed: dict = {}

    def walk(tree: dict, prefix: tuple) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, prefix + (key,))
            elif _is_strided(value):
                placements = tuple(Replicate() if isinstance(p, _StridedShard) else p
                                   for p in value.placements)
                changed[prefix + (key,)] = (value.device_mesh, value.placements)
                tree[key] = value.redistribute(value.device_mesh, placements)

    walk(state, ())
    return changed


def restride(state: dict, changed: dict) -> None:
    """Put the tensors :func:`unstride` replicated back into their strided layout (after a
    load filled them): each rank keeps its own rows, no communication."""
    from torch.distributed.tensor import distribute_tensor  # lazy: torch.distributed

    for path, (mesh, placements) in changed.items():
        tree = state
        for key in path[:-1]:
            tree = tree[key]
        whole = tree[path[-1]]
        tree[path[-1]] = distribute_tensor(whole.full_tensor(), mesh, placements,
                                           src_data_rank=None)
