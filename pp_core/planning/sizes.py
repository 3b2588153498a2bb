"""Byte sizes as people type and read them: ``512MiB``, ``8GiB``, ``1.5 GB``.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) of 1000,
because a memory cap is compared with what a device reports (``torch.cuda.mem_get_info``: bytes)
and the two are easy to mix up; a bare number is bytes.
"""

from __future__ import annotations

import re

from pp_core.errors import ConfigError

__all__ = ["parse_size", "format_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2,
          "g": 1000 ** 3, "gb": 1000 ** 3, "t": 1000 ** 4, "tb": 1000 ** 4,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text, what: str = "--memory-cap") -> int:
    """Bytes from ``"8GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1000000"`` (or an int)."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = _PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{what}={text!r} is not a size; write a number with a unit, e.g. "
                          f"512MiB, 8GiB or 1.5GB (KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB "
                          f"of 1000, a bare number is bytes)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"{what}={text!r} must be more than 0 bytes")
    return size


def format_bytes(num: float | None) -> str:
    """``1.5 GiB``-style: what a reader compares with a ``--memory-cap`` they typed."""
    if num is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024:
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} TiB"
