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


def _rng_key() -> str:
    """This rank's random-number state, named by rank and world size: it is restored only into
    the same rank of the same world (another layout draws differently anyway)."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    return f"rank{rank}of{world}"


def rng_states() -> dict[str, torch.Tensor]:
    """``{"<rank key>.cpu": ..., "<rank key>.cuda": ...}``: the generators dropout and friends
    draw from, so a resumed (or restarted) run draws what the uninterrupted one drew."""
    key = _rng_key()
    found = {f"{key}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        found[f"{key}.cuda"] = torch.cuda.get_rng_state()
    return found


def restore_rng(state: dict, stored) -> None:
    """Keep in ``state["rng"]`` only what the checkpoint holds (``stored``: its metadata's keys);
    call again after the load with ``stored=None`` to set the generators from it."""
    rng = state.get("rng", {})
    if stored is not None:
        for name in [n for n in rng if f"rng.{n}" not in stored]:
            del rng[name]
        return
    for name, value in rng.items():
        if name.endswith(".cpu"):
            torch.set_rng_state(value)
        elif name.endswith(".cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state(value)


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
    state = {"model": model, "optim": optim, "trainer": {"step": torch.tensor(step)},
             "rng": rng_states()}
    return state, unstride(state)  # DCP writes no strided shard (the fused qkv): whole ones
