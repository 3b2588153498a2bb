"""The one table of what pipeline actions are called wherever a person reads them.

A Chrome trace (simulated, traced or recorded by ``pp-core run``), the SVG of a schedule and a
``torch.profiler`` trace all name actions from here, so an action reads the same in each: by its
compact form (``"2F0"``, ``"3SEND_F1"``, see :class:`pp_core.schedule.ir.Action`), grouped by
the category of its kind. Pure Python, like the rest of the schedule half.
"""

from __future__ import annotations

__all__ = ["KINDS", "COMM", "WAIT", "PROFILER_PREFIX", "category", "short_name", "colour",
           "profiler_label", "kind_of_label"]

# kind -> (category in traces, short name in a schedule's legend, Chrome's reserved colour name)
KINDS = {
    "F": ("forward", "forward", "thread_state_running"),
    "B": ("backward", "backward", "rail_response"),
    "I": ("backward (input grads)", "input grad", "thread_state_iowait"),
    "W": ("backward (weight grads)", "weight grad", "rail_idle"),
}
COMM = "comm"  # category of SEND_F / RECV_F / SEND_B / RECV_B
WAIT = "wait"  # category of the time an action spends waiting for a peer's message
_COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
PROFILER_PREFIX = "PP:"


def category(kind: str) -> str:
    """``"forward"``, ``"backward"``, ... for a compute kind; ``"comm"`` for the others."""
    row = KINDS.get(str(kind))
    return row[0] if row is not None else COMM


def short_name(kind: str) -> str:
    """The name a schedule's legend gives a compute kind (``"input grad"``)."""
    return KINDS[str(kind)][1]


def colour(kind: str) -> str | None:
    """Chrome's colour name for a compute kind, so every viewer shows F/B/I/W apart."""
    row = KINDS.get(str(kind))
    return row[2] if row is not None else None


def profiler_label(action) -> str:
    """The ``torch.profiler`` record of an action: ``"PP:"`` + its compact form (``PP:1F3``,
    ``PP:0SEND_F3``), so a search for ``PP:`` in a profiler trace finds every pipeline action."""
    return PROFILER_PREFIX + str(action)


def kind_of_label(name: str) -> str:
    """The kind in a compact label (``"12SEND_B3"`` -> ``"SEND_B"``), else ``name`` itself
    (``"wait_sends"``)."""
    stripped = name.lstrip("0123456789")
    for kind in _COMM_KINDS:
        if stripped.startswith(kind):
            return kind
    return stripped[:1] if stripped[:1] in KINDS else name
