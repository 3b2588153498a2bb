"""The state a checkpoint holds, as DCP reads and writes it: ``model.<name>``, the optimizer's
state flattened per parameter name, ``trainer.step`` (the format: :mod:`pp_core.checkpoint`).

Saving and loading build the same dict, so a load asks DCP for exactly the keys a save of this
layout writes: expert shards wrapped as whole tensors, strided TP shards made whole.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from pp_core.checkpoint.expert_state import expert_dtensors
from pp_core.parallel.dtensor_state import unstride


@contextlib.contextmanager
def single_process_quiet():
    """Without a process group DCP warns that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message=".*assuming the intent is to",
                                    category=UserWarning)
        yield


def flat_optimizer_options():
    """The optimizer state keyed by parameter name (``optim.state.<name>.<slot>``), not by index."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # lazy: DCP, seconds

    return StateDictOptions(flatten_optimizer_state_dict=True)


def state_dicts(parts: Iterable[nn.Module], optimizers: Iterable, step: int) -> tuple[dict, dict]:
    """The dict DCP saves or loads into for this rank's parts, and the strided TP shards made
    whole in it (for :func:`~pp_core.parallel.dtensor_state.restride` after a load)."""
    from torch.distributed.checkpoint.state_dict import (  # lazy: DCP, seconds
        get_model_state_dict, get_optimizer_state_dict)

    model: dict = {}
    optim: dict = {}
    for part, optimizer in zip(parts, optimizers):
        model.update(get_model_state_dict(part))
        if optimizer is not None:
            optim.update(get_optimizer_state_dict(part, optimizer,
                                                  options=flat_optimizer_options()))
    expert_dtensors(parts, model, optim)  # ep shards: whole experts in the file, any ep loads
    state = {"model": model, "optim": optim, "trainer": {"step": torch.tensor(step)}}
    return state, unstride(state)  # DCP writes no strided shard (the fused qkv): whole ones
