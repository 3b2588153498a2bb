"""Kept import path: the MoE token dispatch moved into the library, :mod:`pp_core.parallel.expert`.

``from pp_core_builtins.models.moe_dispatch import dispatch_to_experts`` still works; new code
imports ``pp_core.parallel.expert`` (the dispatch, the workspace and its initializer) - the public
name a third-party MoE model uses (docs/plugins.md). ``inject_aux_loss`` now takes the step's
scale (``pp_core.parallel.expert.aux_loss``).
"""

from pp_core.parallel.expert.aux_loss import inject_aux_loss
from pp_core.parallel.expert.dispatch import (_WORKSPACES, AllToAll, DispatchWorkspace,  # noqa: F401
                                              DispatchWorkspaceInitializer, dispatch_to_experts,
                                              group_name, reset_workspaces, workspace_for)
from pp_core_builtins.models.moe_gpt import WORKSPACE_NAME

__all__ = ["DispatchWorkspace", "DispatchWorkspaceInitializer", "workspace_for",
           "reset_workspaces", "AllToAll", "dispatch_to_experts", "inject_aux_loss",
           "WORKSPACE_NAME"]
