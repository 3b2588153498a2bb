"""The schedule IR: actions and per-rank programs as plain data.

An :class:`Action` is ``(stage, kind, microbatch)`` with the compact form ``"2F0"`` that torch
uses. A *compute-only* schedule holds F/B/I/W actions; lowering adds the communication kinds
(SEND_F/RECV_F/SEND_B/RECV_B), whose ``stage`` is, as in torch, the stage on *this* rank that
sends or receives: ``3SEND_F1`` sends stage 3's output of microbatch 1 to stage 4's rank,
``4RECV_F1`` receives it there; ``4SEND_B1`` sends stage 4's input gradient back to stage 3's
rank, ``3RECV_B1`` receives it.
"""

from __future__ import annotations

import enum
import re
from typing import NamedTuple

from pp_core.errors import ScheduleError, quoted

__all__ = [
    "ActionKind",
    "Action",
    "F",
    "B",
    "I",
    "W",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "parse_action",
    "format_actions",
    "Placement",
    "ScheduleDef",
    "Schedule",
    "stage_to_rank",
]


class ActionKind(str, enum.Enum):
    """What an action does. The value is its spelling in the compact form and in CSV files."""

    FORWARD = "F"
    FULL_BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value


F = ActionKind.FORWARD
B = ActionKind.FULL_BACKWARD
I = ActionKind.BACKWARD_INPUT  # noqa: E741 - torch's letter for the input-gradient pass
W = ActionKind.BACKWARD_WEIGHT
SEND_F = ActionKind.SEND_F
RECV_F = ActionKind.RECV_F
SEND_B = ActionKind.SEND_B
RECV_B = ActionKind.RECV_B

COMPUTE_KINDS = frozenset({F, B, I, W})
COMM_KINDS = frozenset({SEND_F, RECV_F, SEND_B, RECV_B})


class Action(NamedTuple):
    """One step of a rank's program: ``kind`` applied to ``microbatch`` on ``stage``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> "Action":
        return parse_action(text)


# Longest kinds first so "SEND_F" is not read as "S..." garbage.
_KIND_ALTERNATION = "|".join(sorted((re.escape(k.value) for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"([0-9]+)({_KIND_ALTERNATION})([0-9]+)")  # ASCII digits only:
# \d would also take full-width and other scripts' digits, which int() then reads


MAX_INDEX_DIGITS = 9  # stage and microbatch numbers: a billion is beyond any real schedule


def parse_action(text: str) -> Action:
    """Parse ``"2F0"`` strictly: the whole string must be ``<stage><kind><microbatch>``.

    Unlike torch, ``"0F1junk"`` and ``"0F"`` are rejected; the message gives the position.
    """
    stripped = text.strip()
    match = _ACTION_RE.fullmatch(stripped)
    if match:
        for group, what in ((1, "stage"), (3, "microbatch")):
            if len(match.group(group)) > MAX_INDEX_DIGITS:
                raise ScheduleError(
                    f"cannot parse action {quoted(text)}: its {what} number has "
                    f"{len(match.group(group)):,} digits; no schedule has more than "
                    f"{MAX_INDEX_DIGITS} digits' worth of {what}s")
        return Action(int(match.group(1)), ActionKind(match.group(2)), int(match.group(3)))
    digits = re.match(r"[0-9]*", stripped).end()
    if digits == 0:
        reason = "it must start with a stage number"
        position = 0
    else:
        kind_match = re.compile(_KIND_ALTERNATION).match(stripped, digits)
        if kind_match is None:
            kinds = ", ".join(k.value for k in ActionKind)
            reason = f"expected an action kind ({kinds})"
            position = digits
        else:
            mb = re.compile(r"[0-9]+").match(stripped, kind_match.end())
            if mb is None:
                reason = "expected a microbatch number"
                position = kind_match.end()
            else:
                reason = "unexpected trailing characters"
                position = mb.end()
    raise ScheduleError(
        f"cannot parse action {quoted(text)}: {reason} at position {position}; "
        f"write actions as <stage><kind><microbatch>, e.g. '2F0' or '1I3'"
    )


def format_actions(actions) -> str:
    """Space-separated compact form of a rank's actions (``None`` = idle, shown as ``.``)."""
    return " ".join("." if a is None else str(a) for a in actions)


# ----------------------------------------------------------------------------- schedules

from dataclasses import dataclass  # noqa: E402
from typing import Callable, Sequence, Union  # noqa: E402

Placement = Union[str, Callable[[int, int], Sequence[int]]]
"""``"loop"`` (stage s on rank s % num_ranks), ``"v"`` (zig-zag: rank r holds r and 2p-1-r, ...),
or ``placement(num_stages, num_ranks) -> rank of each stage``."""


def stage_to_rank(placement: Placement, num_stages: int, num_ranks: int) -> tuple[int, ...]:
    """The rank of every stage under ``placement``."""
    if callable(placement):
        ranks = tuple(int(r) for r in placement(num_stages, num_ranks))
        if len(ranks) != num_stages or any(not 0 <= r < num_ranks for r in ranks):
            raise ScheduleError(
                f"placement {placement!r} returned {list(ranks)} for num_stages={num_stages}, "
                f"num_ranks={num_ranks}; it must return one rank in [0, {num_ranks}) per stage"
            )
        return ranks
    if placement == "loop":
        return tuple(s % num_ranks for s in range(num_stages))
    if placement == "v":
        ranks = []
        for s in range(num_stages):
            lap, offset = divmod(s, num_ranks)
            ranks.append(offset if lap % 2 == 0 else num_ranks - 1 - offset)
        return tuple(ranks)
    raise ScheduleError(f"unknown placement {placement!r}; use 'loop', 'v' or a callable")


@dataclass(frozen=True)
class ScheduleDef:
    """What a schedule plugin registers: how to generate the order, and for which shapes.

    ``generate(num_stages, num_microbatches, num_ranks)`` returns one list of compute actions
    per rank. :func:`~pp_core.schedule.build.build_schedule` calls it only with
    ``num_ranks >= 1``, ``num_microbatches >= 1`` and ``num_stages = num_ranks * v``, ``v`` being
    ``stages_per_rank`` unless ``variable_stages_per_rank`` lets the caller choose it (those
    checks and their messages live there, once). The generator raises
    :class:`~pp_core.ScheduleError` only for sizes its own algorithm does not admit (e.g. a
    microbatch count, or ``v < 2`` for a looped schedule), naming the constraint and the nearest
    valid values.
    """

    generate: Callable[[int, int, int], list]
    aliases: tuple[str, ...] = ()
    placement: Placement = "loop"
    stages_per_rank: int = 1
    """The default number of stages each rank holds."""
    variable_stages_per_rank: bool = False
    """Whether other stage counts per rank are accepted (looped schedules: any value >= 2)."""
    description: str = ""


@dataclass
class Schedule:
    """A compute-only schedule: per-rank ordered actions plus the stage placement.

    ``actions[r]`` may contain ``None`` (an idle step, as in torch's CSV files); ``stage_ranks[s]``
    is the rank that holds stage ``s``.
    """

    actions: list[list[Action | None]]
    stage_ranks: tuple[int, ...]
    num_microbatches: int
    name: str = "custom"
    edges: tuple[tuple[int, int], ...] | None = None
    """Which stage's output feeds which, as ``(from stage, to stage)`` pairs; ``None``: the
    chain ``0 -> 1 -> ... -> num_stages - 1``. Read only through
    :func:`pp_core.schedule.replay.stage_graph`, so a pipeline that is not a chain is data."""
    seq_chunks: int = 1
    """Sequence slices per microbatch (``pipeline.pp_seq_chunks``). With ``K > 1`` an action's
    ``microbatch`` numbers a *unit*, slice ``u % K`` of microbatch ``u // K``, and
    ``num_microbatches`` counts units (``K`` times the microbatches); slice ``j``'s forward on a
    stage follows slice ``j - 1``'s there and its backward precedes it
    (:mod:`pp_core.schedule.replay`)."""

    @property
    def num_sequences(self) -> int:
        """The microbatches of the step (``num_microbatches`` counts slices when cut)."""
        return self.num_microbatches // self.seq_chunks

    def unit_label(self, unit: int) -> str:
        """How a unit is written for people: ``"5"``, or ``"2.1"`` (microbatch 2, slice 1)."""
        if self.seq_chunks == 1:
            return str(unit)
        return f"{unit // self.seq_chunks}.{unit % self.seq_chunks}"

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in order.

        The per-rank map is built once per ``stage_ranks`` (one pass over the stages), so asking
        for every rank is linear in the number of stages, not quadratic.
        """
        return self._stages_by_rank().get(rank, ())

    def _stages_by_rank(self) -> dict[int, tuple[int, ...]]:
        cached = self.__dict__.get("_stage_map")
        if cached is None or cached[0] is not self.stage_ranks:  # built for another placement
            by_rank: dict[int, list[int]] = {}
            for stage, rank in enumerate(self.stage_ranks):
                by_rank.setdefault(rank, []).append(stage)
            cached = (self.stage_ranks, {r: tuple(stages) for r, stages in by_rank.items()})
            self.__dict__["_stage_map"] = cached
        return cached[1]

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a is not None]

    def rows(self) -> list[str]:
        return [format_actions(self.compute_actions(r)) for r in range(self.num_ranks)]
