"""Peak resident memory on Linux, shared by the hand-run benchmarks.

torch's CPU allocations are invisible to tracemalloc, so the benchmarks read ``/proc/self/status``
instead: ``VmRSS`` now, ``VmHWM`` the peak since the last :func:`reset_peak`.
"""


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` memory field (``"VmRSS"``, ``"VmHWM"``) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current resident set (``clear_refs`` 5, Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
