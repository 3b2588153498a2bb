"""Expert-parallel parameters in a checkpoint: whole tensors in the file, any ep size to load.

With ``distributed.ep_size > 1`` each rank holds ``num_experts / ep_size`` contiguous experts of a
stacked expert weight (``[experts, ...]``, marked ``pp_expert_parallel``) as a plain tensor under
the whole weight's name. Before DCP sees a state dict, :func:`expert_dtensors` wraps each such
tensor - and its optimizer moments - as a DTensor ``Shard(0)`` over the ep group (the group's
rank order is the experts' order), so DCP records the whole shape and each rank's rows: the file
is the one an ep1 run writes, the expert-dp copies (ranks holding the same experts) are written
once (DCP deduplicates equal chunks), and a load at any ep size reads the rows it holds.
:func:`expert_locals` unwraps them again after a load. Nothing changes without expert
parallelism.
"""

from __future__ import annotations

import torch

__all__ = ["expert_dtensors", "expert_locals"]

_MARK = "pp_core_expert_shard"
_meshes: dict = {}


def _group_of(part, name: str):
    """The ep process group of the module owning parameter ``name`` (the nearest module on its
    path that records one: ``pp_ep_group`` or ``ep_group``)."""
    modules = dict(part.named_modules())
    path = name.split(".")[:-1]
    while True:
        module = modules.get(".".join(path))
        for attr in ("pp_ep_group", "ep_group"):
            group = getattr(module, attr, None) if module is not None else None
            if group is not None:
                return group
        if not path:
            return None
        path.pop()


def _mesh(group, device):
    from torch.distributed.device_mesh import DeviceMesh  # lazy: torch.distributed

    key = (id(group), device.type)
    if key not in _meshes:
        _meshes[key] = DeviceMesh.from_group(group, device.type)
    return _meshes[key]


def _wrap(local: torch.Tensor, mesh):
    from torch.distributed.tensor import DTensor, Shard  # lazy: torch.distributed

    shape = (local.shape[0] * mesh.size(),) + tuple(local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    value = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                               stride=stride)
    setattr(value, _MARK, True)
    return value


def expert_dtensors(parts, model_state: dict, optim_state: dict | None = None) -> int:
    """Wrap this rank's expert shards in ``model_state`` (and their moments in the flattened
    ``optim_state``, keys ``state.<name>.<slot>``) as ``Shard(0)`` DTensors, in place; returns
    how many parameters were wrapped."""
    wrapped = 0
    for part in parts:
        for name, param in part.named_parameters():
            if not getattr(param, "pp_expert_parallel", False) or name not in model_state:
                continue
            group = _group_of(part, name)
            if group is None:
                continue
            mesh = _mesh(group, param.device)
            model_state[name] = _wrap(model_state[name], mesh)
            wrapped += 1
            for key, value in (optim_state or {}).items():
                if key.startswith(f"state.{name}.") and isinstance(value, torch.Tensor) \
                        and value.shape == param.shape and not hasattr(value, "device_mesh"):
                    optim_state[key] = _wrap(value, mesh)
    return wrapped


def expert_locals(tree: dict) -> None:
    """Replace every DTensor :func:`expert_dtensors` made in ``tree`` (nested dicts) by its
    local tensor (which a load filled in place)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            expert_locals(value)
        elif getattr(value, _MARK, False):
            tree[key] = value.to_local()
