"""Strided DTensor shards in a state dict that DCP writes and reads.

A ``_StridedShard`` on the tp dimension (the fused ``qkv`` projection's column-wise shard: tp
rank r holds the r-th rows of q, of k and of v) is not one contiguous block of the whole tensor,
but DCP describes each rank's piece of a DTensor as one chunk (an offset and a size): it would
record overlapping chunks and refuse to save (``overlapping chunks``), or misplace rows. FSDP2
over TP shards that tp shard again along rows over ``dp_shard`` (placements
``(_StridedShard(0, sf=2), _StridedShard(0, sf=3))``), which torch 2.13's own ``full_tensor()``
reassembles in the wrong order. So before DCP sees a state dict, each such DTensor becomes its
whole tensor, replicated over its mesh (transiently: one fused weight or moment at a time in
memory), assembled by hand in the order the shards were made (tp first, then the outer dp
dimensions); after a load each rank cuts its own piece back out of the whole, no communication.
The file is then the same as that of any other layout, and loads at any dp, tp or pp size (or
into the unsplit model).
"""

from __future__ import annotations

__all__ = ["unstride", "restride"]


def _strided_dim(value) -> int | None:
    """The mesh dimension of a DTensor's tensor-parallel ``_StridedShard`` (the innermost one,
    with only ``Replicate`` inside it), or ``None`` when DCP can take the tensor as it is."""
    from torch.distributed.tensor import Replicate  # lazy: torch.distributed
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = tuple(getattr(value, "placements", ()))
    strided = [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    if not strided or not all(isinstance(p, Replicate) for p in placements[strided[-1] + 1:]):
        return None
    mesh = value.device_mesh
    return strided[-1] if mesh.ndim == 1 or mesh.mesh_dim_names else None


def _dim_mesh(mesh, index: int):
    """The 1-D sub-mesh of ``mesh``'s dimension ``index``."""
    return mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[index]]


def _whole(value, inner: int):
    """The whole tensor of ``value``: the outer dimensions' shards gathered (innermost first,
    each along its tensor dim, as FSDP2 made them from the tp-local tensor), then the tp strided
    shard replicated by DTensor itself (a 1-D strided shard it reassembles correctly)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard  # lazy: torch.distributed
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, placements = value.device_mesh, value.placements
    tp_shape = list(value.shape)
    tp_shape[placements[inner].dim] //= mesh.size(inner)
    local = value.to_local()
    for index in reversed(range(inner)):
        placement = placements[index]
        if isinstance(placement, (Shard, _StridedShard)):  # FSDP2's rows of the tp shard
            piece = DTensor.from_local(local, _dim_mesh(mesh, index), [Shard(placement.dim)],
                                       run_check=False, shape=tuple(tp_shape),
                                       stride=_contiguous(tp_shape))
            local = piece.full_tensor()
    tp_mesh = _dim_mesh(mesh, inner)
    tp = DTensor.from_local(local, tp_mesh, [placements[inner]], run_check=False,
                            shape=value.shape, stride=value.stride())
    return tp.redistribute(tp_mesh, [Replicate()]).to_local()


def _contiguous(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def unstride(state: dict) -> dict:
    """``state`` (nested dicts) with every tensor-parallel ``_StridedShard`` DTensor replaced by
    its whole tensor replicated over its mesh; returns ``{path: (mesh, placements, inner)}`` of
    those it changed, for :func:`restride`."""
    from torch.distributed.tensor import DTensor, Replicate  # lazy: torch.distributed

    changed: dict = {}

    def walk(tree: dict, prefix: tuple) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, prefix + (key,))
            elif (inner := _strided_dim(value)) is not None:
                mesh = value.device_mesh
                changed[prefix + (key,)] = (mesh, value.placements, inner)
                tree[key] = DTensor.from_local(_whole(value, inner), mesh,
                                               [Replicate()] * mesh.ndim, run_check=False)

    walk(state, ())
    return changed


def restride(state: dict, changed: dict) -> None:
    """Put the tensors :func:`unstride` replaced back into their sharded layout (after a load
    filled them): each rank cuts its own piece from the whole, tp first, then the outer
    dimensions in mesh order."""
    from torch.distributed.tensor import (  # lazy: torch.distributed
        DTensor, Shard, distribute_tensor)
    from torch.distributed.tensor.placement_types import _StridedShard

    for path, (mesh, placements, inner) in changed.items():
        tree = state
        for key in path[:-1]:
            tree = tree[key]
        whole = tree[path[-1]].to_local()
        local = distribute_tensor(whole, _dim_mesh(mesh, inner), [placements[inner]],
                                  src_data_rank=None).to_local()
        for index in range(inner):
            if isinstance(placements[index], (Shard, _StridedShard)):
                local = distribute_tensor(local, _dim_mesh(mesh, index),
                                          [Shard(placements[index].dim)],
                                          src_data_rank=None).to_local()
        tree[path[-1]] = DTensor.from_local(local, mesh, placements, run_check=False,
                                            shape=whole.shape, stride=whole.stride())
