"""The one device mesh of a run, built from the YAML ``distributed`` section.

Dimensions ``("pp", "dp_replicate", "dp_shard", "tp")``: pp outermost, tp innermost (its
per-layer collectives stay between neighbouring ranks, on one node; only activations cross
nodes), as torchtitan lays them out. Sub-meshes: ``mesh["pp"]`` for the pipeline's peers (they
share the dp and tp coordinates: tp rank r of stage s talks only to tp rank r of stage s+-1),
``mesh["dp_replicate", "dp_shard"]`` for torch's data parallelism, ``mesh["tp"]`` for
``apply_tensor_parallel``. Add a dimension here (and only here) to lay out a new parallelism.
"""

from __future__ import annotations

__all__ = ["MESH_DIMS", "mesh_shape", "build_device_mesh"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def mesh_shape(distributed: dict) -> tuple[int, ...]:
    """The sizes of :data:`MESH_DIMS` from a ``distributed`` section (missing keys: 1)."""
    return tuple(int(distributed.get(key, 1)) for key in
                 ("pp_size", "dp_replicate", "dp_shard", "tp_size"))


def build_device_mesh(distributed: dict, device_type: str):
    """``init_device_mesh`` over every rank of the job, dimensions :data:`MESH_DIMS`."""
    from torch.distributed.device_mesh import init_device_mesh  # lazy: torch.distributed

    return init_device_mesh(device_type, mesh_shape(distributed), mesh_dim_names=MESH_DIMS)
