"""Receive-buffer sizing from a lowered program: interval colouring of receive lifetimes.

Why this exists. A pipeline runtime receives every microbatch's activations (``RECV_F``) and
input gradients (``RECV_B``) into pre-allocated buffers. torch allocates one buffer *set* (all the
tensors of one receive) per microbatch and direction and keeps them for the life of the stage, so
a stage costs ``num_microbatches`` sets per direction. Most of them are idle most of the time: a
buffer only has to exist while the message may still be written into it or read out of it.

Lifetimes. Lowering (:mod:`pp_core.schedule.lower`) records, for every ``RECV`` of a rank, the
index where it is *posted* (the ``irecv``) and the index of the compute that *consumes* it (the
runtime waits for the message right before that compute). The receive-buffer pool copies the
message out of its buffer at that moment - a received input into an independent leaf before its
forward, a received gradient before its backward - so the buffer is free again right after
``consumed``. A receive therefore occupies its buffer on the closed interval
``[posted, consumed]`` of program indices, and two receives may share a buffer exactly when their
intervals are disjoint. (Without the copy the buffer would have to live until ``released``, the
backward that lets autograd drop it; :func:`plan_recv_buffers` can size that too, for comparison.)

Colouring. Receives are grouped into *classes*, one per ``(stage, direction)`` of the rank: the
receives of one class carry tensors of the same structure (the same stage input, or the same stage
output gradient), so one buffer set can serve any of them. Within a class, assigning buffers is
colouring an interval graph, and the greedy sweep over intervals in order of start - take any free
buffer, return it at the interval's end - uses exactly ``max_live`` buffers, the largest number of
receives live at one index, which is also a lower bound for any assignment. The pool keeps
``slack`` extra sets per class (``PipelineConfig.pp_recv_buffer_pool_slack``) and hands out the
least recently freed set, so a buffer is rewritten as late as possible.

For 1F1B this gives one set per direction (plus slack) on every stage, never more than NeMo
AutoModel's ring of ``num_stages - stage_index + slack``. Pure Python: no torch.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, Optional

from pp_core.errors import ScheduleError
from pp_core.schedule.ir import RECV_B, RECV_F, Action, ActionKind

__all__ = [
    "BufferClass",
    "ClassPlan",
    "RankBufferPlan",
    "plan_recv_buffers",
    "plan_program",
    "max_live",
    "colour_intervals",
    "recv_buffer_report",
]

LIFETIME_ENDS = ("consumed", "released")


class BufferClass(NamedTuple):
    """Receives that can share buffer sets: one stage of the rank, one direction."""

    stage: int
    kind: ActionKind  # RECV_F or RECV_B

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}"


def max_live(intervals: Iterable[tuple[int, int]]) -> int:
    """The largest number of closed intervals ``[start, end]`` that share one point."""
    events = []
    for start, end in intervals:
        if end < start:
            raise ScheduleError(f"interval [{start}, {end}] ends before it starts")
        events.append((start, 0))  # at equal points a start counts before an end (closed)
        events.append((end, 1))
    events.sort()
    live = peak = 0
    for _, is_end in events:
        if is_end:
            live -= 1
        else:
            live += 1
            peak = max(peak, live)
    return peak


def colour_intervals(intervals: list[tuple[int, int]], slack: int = 0) -> tuple[list[int], int]:
    """Assign each closed interval a colour so that overlapping intervals differ.

    Greedy sweep by start, reusing the least recently freed colour, over a palette of
    ``max_live + slack`` colours. Returns ``(colour per interval, palette size)``. Two intervals
    share a colour only if one ends strictly before the other starts.
    """
    if slack < 0:
        raise ScheduleError(f"slack must be >= 0, got {slack}")
    need = max_live(intervals)
    palette = need + slack
    order = sorted(range(len(intervals)), key=lambda i: intervals[i][0])
    free = deque(range(palette))
    ends: list[tuple[int, int]] = []  # heap of (end, colour) of the live intervals
    colours = [-1] * len(intervals)
    for i in order:
        start, end = intervals[i]
        while ends and ends[0][0] < start:
            free.append(heapq.heappop(ends)[1])
        colour = free.popleft()  # never empty: at most need - 1 others are live here
        colours[i] = colour
        heapq.heappush(ends, (end, colour))
    return colours, palette



@dataclass(frozen=True)
class ClassPlan:
    """The plan for one class of receives: how many buffer sets, and which receive uses which.

    ``lower_bound`` is the most receives of the class live at once (no assignment can use fewer
    sets); ``sets = lower_bound + slack``; ``default_sets`` is what torch allocates (one set per
    receive of the class, i.e. per microbatch).
    """

    buffer_class: BufferClass
    lower_bound: int
    slack: int
    default_sets: int
    slots: Mapping[int, int]  # microbatch -> buffer set index

    @property
    def sets(self) -> int:
        return self.lower_bound + self.slack


@dataclass(frozen=True)
class RankBufferPlan:
    """Every receive class of one rank, planned from that rank's program."""

    rank: int
    slack: int
    lifetime_end: str
    classes: Mapping[BufferClass, ClassPlan]

    def slot(self, action: Action) -> int:
        """The buffer set the receive ``action`` (e.g. ``3RECV_F5``) uses within its class."""
        plan = self.classes.get(BufferClass(action.stage, action.kind))
        if plan is None or action.microbatch not in plan.slots:
            raise ScheduleError(f"rank {self.rank}'s program has no receive {action}")
        return plan.slots[action.microbatch]

    def sets(self, stage: int, kind: ActionKind) -> int:
        plan = self.classes.get(BufferClass(stage, kind))
        return 0 if plan is None else plan.sets


def plan_recv_buffers(program, slack: int = 0, lifetime_end: str = "consumed") -> RankBufferPlan:
    """Plan one rank's receive buffers from its lowered program.

    :param program: a :class:`pp_core.schedule.lower.RankProgram` (what the
        ``pp_make_recv_buffer_allocator`` hook receives).
    :param slack: extra buffer sets per class (``pp_recv_buffer_pool_slack``).
    :param lifetime_end: ``"consumed"`` (the pool copies each message out before its compute:
        what pp-core's pool does) or ``"released"`` (buffers used in place until the backward that
        frees them, what a pool without the copy would need).
    """
    if lifetime_end not in LIFETIME_ENDS:
        raise ScheduleError(f"lifetime_end={lifetime_end!r}; use one of {LIFETIME_ENDS}")
    if not isinstance(slack, int) or isinstance(slack, bool) or slack < 0:
        raise ScheduleError(f"slack={slack!r} must be an int >= 0 (pp_recv_buffer_pool_slack)")
    grouped: dict[BufferClass, list] = {}
    for lifetime in program.recv_lifetimes:
        action = lifetime.action
        if action.kind not in (RECV_F, RECV_B):
            raise ScheduleError(f"rank {program.rank}: lifetime of {action}, which is not a RECV")
        end = lifetime.consumed if lifetime_end == "consumed" else lifetime.released
        grouped.setdefault(BufferClass(action.stage, action.kind), []).append(
            (lifetime.posted, end, action.microbatch))
    classes = {}
    for buffer_class in sorted(grouped, key=lambda c: (c.stage, c.kind is RECV_B)):
        entries = grouped[buffer_class]
        intervals = [(start, end) for start, end, _ in entries]
        colours, palette = colour_intervals(intervals, slack)
        classes[buffer_class] = ClassPlan(
            buffer_class=buffer_class,
            lower_bound=palette - slack,
            slack=slack,
            default_sets=len(entries),
            slots={mb: colour for (_, _, mb), colour in zip(entries, colours)},
        )
    return RankBufferPlan(program.rank, slack, lifetime_end, classes)


def plan_program(program, slack: int = 0,
                 lifetime_end: str = "consumed") -> list[RankBufferPlan]:
    """:func:`plan_recv_buffers` for every rank of a :class:`~pp_core.schedule.lower.Program`."""
    return [plan_recv_buffers(program.rank(r), slack, lifetime_end)
            for r in range(program.num_ranks)]


def recv_buffer_report(program, slack: int = 2,
                       bytes_per_set: Optional[Mapping[tuple[int, str], int] | int] = None) -> dict:
    """Receive-buffer figures of a lowered program, before anything runs (JSON-ready).

    Per rank and per receive class: ``default_sets`` (torch: one per microbatch), ``lower_bound``
    (most receives live at once with copy-out at consumption), ``pool_sets`` (lower bound +
    slack), ``no_copy_lower_bound`` (what in-place reuse until release would need) and
    ``nemo_ring`` for comparison (``num_stages - stage + slack``, NeMo AutoModel's 1F1B ring).
    With ``bytes_per_set`` (an int for every class, or a mapping ``(stage, "F"|"B") -> bytes``)
    the byte figures are added too.
    """
    num_stages = program.num_stages
    ranks = []
    totals = {"default_sets": 0, "pool_sets": 0, "default_bytes": 0, "pool_bytes": 0}
    for rank in range(program.num_ranks):
        rank_program = program.rank(rank)
        plan = plan_recv_buffers(rank_program, slack)
        released = plan_recv_buffers(rank_program, 0, "released")
        rows = []
        for buffer_class, class_plan in plan.classes.items():
            direction = "F" if buffer_class.kind is RECV_F else "B"
            row = {
                "stage": buffer_class.stage,
                "direction": direction,
                "default_sets": class_plan.default_sets,
                "lower_bound": class_plan.lower_bound,
                "pool_sets": class_plan.sets,
                "no_copy_lower_bound": released.classes[buffer_class].lower_bound,
                "nemo_ring": num_stages - buffer_class.stage + slack,
            }
            totals["default_sets"] += row["default_sets"]
            totals["pool_sets"] += row["pool_sets"]
            size = _bytes_for(bytes_per_set, buffer_class.stage, direction)
            if size is not None:
                row["default_bytes"] = size * row["default_sets"]
                row["pool_bytes"] = size * row["pool_sets"]
                totals["default_bytes"] += row["default_bytes"]
                totals["pool_bytes"] += row["pool_bytes"]
            rows.append(row)
        ranks.append({"rank": rank, "classes": rows})
    if bytes_per_set is None:
        del totals["default_bytes"], totals["pool_bytes"]
    return {"slack": slack, "lifetime": "posted..consumed (copy-out)", "ranks": ranks,
            "total": totals}


def _bytes_for(bytes_per_set, stage: int, direction: str) -> Optional[int]:
    if bytes_per_set is None:
        return None
    if isinstance(bytes_per_set, int):
        return bytes_per_set
    return bytes_per_set.get((stage, direction))
