"""Every private torch internal that finishes a data-parallel engine's work inside a pipeline.

A pipeline runs a stage's backwards outside FSDP2's / DDP's autograd hooks, so it finishes their
reduction itself, exactly as torch.distributed.pipelining's stage does (``perform_reduce_grad``,
``backward_maybe_with_nosync``). Checked on 2.13, 2.15.0. A chapter of :mod:`pp_core._torch_compat`
(which re-exports every name), kept apart so each stays short.
"""

from __future__ import annotations


def fsdp_reduce_and_reshard(modules) -> None:
    """Run every FSDP2 parameter group's post-backward (reduce-scatter or all-reduce of the
    accumulated gradients, then reshard) of ``modules`` (FSDPModules, sync already switched
    on), then each root's final callback (waits for the reductions, finalises the states)."""
    from torch.distributed._composable_state import _get_module_state  # lazy: private torch API

    states = [_get_module_state(module) for module in modules]
    for state in states:
        for group in reversed(state._fsdp_param_groups):
            group.post_backward()
    for state in states:
        if getattr(state, "_is_root", False):
            state._root_post_backward_final_callback()


def fsdp_reset(modules) -> None:
    """After a failed step: drop FSDP2's per-iteration state of the roots among ``modules``.
    ``FSDPState._reset_iter_state``, checked on 2.13 and 2.15.0; 2.11 and 2.12 lack it, which
    is one reason the supported range starts at 2.13."""
    from torch.distributed._composable_state import _get_module_state  # lazy: private torch API

    for module in modules:
        state = _get_module_state(module)
        if getattr(state, "_is_root", False):
            try:
                state._reset_iter_state()
            except Exception:
                pass


def _fsdp_mesh_infos(modules) -> list:
    from torch.distributed._composable_state import _get_module_state  # lazy: private torch API

    infos: dict = {}
    for module in modules:
        for param_group in getattr(_get_module_state(module), "_fsdp_param_groups", ()):
            for owner in [param_group, *param_group.fsdp_params]:
                for name in ("mesh_info", "post_forward_mesh_info"):
                    info = getattr(owner, name, None)
                    if info is not None:
                        infos[id(info)] = info
    return list(infos.values())


_GROUP_FIELDS = ("shard_process_group", "replicate_process_group")


def fsdp_process_groups(modules) -> list:
    """The process groups FSDP2's collectives of ``modules`` run on (shard and, for HSDP,
    replicate groups), each once."""
    groups: dict = {}
    for info in _fsdp_mesh_infos(modules):
        for name in _GROUP_FIELDS:
            group = getattr(info, name, None)
            if group is not None:
                groups[id(group)] = group
    return list(groups.values())


def ddp_arm_reducer(ddp, outputs) -> None:
    """Make DDP's reducer all-reduce during the next backward, whose forwards ran under
    ``no_sync`` (torch's pipelining stage does the same for its last backward)."""
    from torch.nn.parallel.distributed import _find_tensors  # lazy: private torch API

    ddp.reducer.prepare_for_backward(list(_find_tensors(outputs)))


def fsdp_replicate():
    """torch's FSDP2-based ``replicate`` (DDP semantics; an FSDPModule, so split backward works);
    it lives in ``torch.distributed._composable`` on 2.13 and 2.15.0."""
    from torch.distributed._composable.replicate_with_fsdp import replicate  # lazy: private API

    return replicate
