"""The meshes a multi-rank case runs on: ``ParallelDims(...).build("cpu")``, as ``pp-core run``
lays the ranks out, made once per process group and layout (every rank asks in the same order).
"""

from __future__ import annotations

import torch.distributed as dist

_MESHES: dict = {}


def meshes(**degrees):
    """:class:`~pp_core.parallel.dims.Meshes` of ``ParallelDims(**degrees)`` over every rank."""
    from pp_core.parallel.dims import ParallelDims

    world = id(dist.group.WORLD)
    if _MESHES.get("world") != world:  # a new pool: the old groups are gone
        _MESHES.clear()
        _MESHES["world"] = world
    key = tuple(sorted(degrees.items()))
    if key not in _MESHES:
        _MESHES[key] = ParallelDims(**degrees).build("cpu")
    return _MESHES[key]
