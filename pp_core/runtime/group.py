"""Which process group a pipeline runs over, and how long each of its waits may take.

:func:`resolve_group` accepts what users pass as ``pp_group`` (a ProcessGroup, a 1-D DeviceMesh
or ``None`` for the world); :func:`resolve_timeout` reads ``timeout=`` or ``$PP_CORE_TIMEOUT``
(the launcher checks it once before starting any rank).
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch.distributed as dist

from pp_core.errors import ConfigError

__all__ = ["resolve_group", "resolve_timeout"]


def resolve_group(pp_group) -> tuple[Any, int, int]:
    """``(process group or None, rank, num_ranks)`` for a ProcessGroup, 1-D DeviceMesh or None."""
    if pp_group is not None and hasattr(pp_group, "get_group") and hasattr(pp_group, "ndim"):
        if pp_group.ndim != 1:
            raise ConfigError(f"pp_group is a {pp_group.ndim}-D DeviceMesh; pass its pipeline "
                              f"dimension, e.g. mesh['pp'], or a ProcessGroup")
        pp_group = pp_group.get_group()
    if pp_group is None:
        if not dist.is_available() or not dist.is_initialized():
            return None, 0, 1  # a single-process pipeline: every stage on this rank
        pp_group = dist.group.WORLD
    return pp_group, dist.get_rank(pp_group), dist.get_world_size(pp_group)


def resolve_timeout(value) -> Optional[float]:
    """Seconds each pipeline wait may take: ``value`` (seconds or a timedelta), else
    ``$PP_CORE_TIMEOUT``, else ``None`` (the process group's own timeout)."""
    if value is None:
        env = os.environ.get("PP_CORE_TIMEOUT")
        if not env:
            return None
        try:
            value = float(env)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"PP_CORE_TIMEOUT={env!r} must be a positive, finite number of "
                              f"seconds (e.g. 600), or unset") from None
    if hasattr(value, "total_seconds"):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise ConfigError(f"timeout={value!r} must be a positive, finite number of seconds")
    return float(value)
