"""The run's device mesh from a ``distributed`` mapping: kept for the code that imports it.

:class:`pp_core.parallel.dims.ParallelDims` lays the ranks out (``ParallelDims.of(section).
build(device_type)`` makes the mesh and every group); :func:`build_device_mesh` and
:func:`mesh_shape` are its two answers for a plain ``{"pp_size": 2, "tp_size": 2}`` mapping.
Dimensions ``("pp", "dp_replicate", "dp_shard", "tp")``: pp outermost, tp innermost.
"""

from __future__ import annotations

from pp_core.parallel.dims import MESH_DIMS, ParallelDims

__all__ = ["MESH_DIMS", "mesh_shape", "build_device_mesh"]


def mesh_shape(distributed: dict) -> tuple[int, ...]:
    """The sizes of :data:`MESH_DIMS` from a ``distributed`` section (missing keys: 1)."""
    return ParallelDims.of(distributed).mesh_shape


def build_device_mesh(distributed: dict, device_type: str):
    """The device mesh over every rank of the job (:meth:`ParallelDims.build
    <pp_core.parallel.dims.ParallelDims.build>`), dimensions :data:`MESH_DIMS`."""
    return ParallelDims.of(distributed).build(device_type).mesh
