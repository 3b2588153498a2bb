"""The one walk over an encoded program: the action code, which unit feeds which, the ready loop.

Every pass that asks "when may this action run?" is a client of :class:`Walk`: validation's
deadlock check (:mod:`~pp_core.schedule.validate`, explained by
:mod:`~pp_core.schedule.deadlock`), the timed replays (:mod:`~pp_core.schedule.simulate`,
:mod:`~pp_core.schedule.sharing`) and lowering (:mod:`~pp_core.schedule.lower`, which emits each
action and the messages it implies in the order the walk's rounds run them). Three things live
here and nowhere else.

**The action code.** A schedule of ``M`` microbatches numbers its *units* - one microbatch on
one stage - ``key = stage * M + microbatch``, and packs an action into one int,
``code = key * 8 + KIND_CODE[kind]`` (F=0, B=1, I=2, W=3; the lowered programs' SEND_F=4,
RECV_F=5, SEND_B=6, RECV_B=7). :func:`encode` / :func:`decode` convert one action,
:func:`pack` / :func:`unpack` one code, :func:`columns` a whole row for a hot loop.

**The dependency rule** (:meth:`Dependencies.inputs`, the only place that says it). A unit's
forward reads the forward outputs of the stages before it in the stage graph
(:func:`stage_graph`: ``Schedule.edges``, by default the chain ``0 -> 1 -> ... -> S-1``); its
backward (``B``, or ``I`` when split) reads the input gradients of the stages after it or, on a
stage that ends the model, its own forward (the loss); a ``W`` reads its own ``I``. Whom to wake,
where a message goes and when an input arrives are all derived from it.

**Sequence slices** (issue 47, ``Schedule.seq_chunks = K``: each microbatch cut into K causal
slices, unit ``u`` being slice ``u % K`` of microbatch ``u // K``): the rule's tables are per
*place*, ``place = stage * K + slice``, and the rule gains the slice edge: an ``F`` of slice
``j > 0`` also reads the forward of slice ``j - 1`` on the same stage (the keys and values it
attends to), a ``B``/``I`` of slice ``j < K - 1`` also reads the input gradient of slice
``j + 1`` on the same stage (the gradient of its keys and values: the backward runs the slices
in reverse). The walk, its wake-ups, the deadlock message and the timed replays follow from the
rule unchanged. A stage graph that is not a chain (an image encoder feeding a decoder) is
``Schedule.edges``; what it still needs elsewhere is a SEND that names its peer, for a stage
whose output goes to two other ranks (the IR's ``SEND_F`` names only its own stage, as torch's
does, so lowering refuses that).

**The ready loop** (:meth:`Walk.run`). Every rank runs its next action once all its inputs are
made, and making something wakes the ranks that wait for it; each action has a count of inputs
not yet made, so the walk is linear in the actions. Greedy turns (a rank runs as far as it can)
give validation and the timed replays their answer in any order; lowering takes torch's rounds
(``one_per_turn``: in each round every rank, in rank order, runs at most one action or idle
step), because its output is the order itself.
"""

from __future__ import annotations

import heapq
from typing import Callable, NamedTuple, Sequence

from pp_core.errors import ScheduleError
from pp_core.schedule.ir import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule

__all__ = ["KIND_CODE", "KINDS", "COMPUTE_CODE", "F_CODE", "B_CODE", "I_CODE", "W_CODE", "IDLE",
           "FORWARD", "GRADIENT", "MAKES", "pack", "unpack", "encode", "decode", "columns",
           "StageGraph", "chain", "stage_graph", "Dependencies", "Walk"]

KIND_CODE = {F: 0, B: 1, I: 2, W: 3, SEND_F: 4, RECV_F: 5, SEND_B: 6, RECV_B: 7}
"""The kind's code in a packed action; the compute kinds come first (codes below 4)."""
KINDS = tuple(KIND_CODE)
"""The kind of each code."""
COMPUTE_CODE = {kind: code for kind, code in KIND_CODE.items() if code < 4}
"""The codes of the kinds a compute-only schedule holds."""
F_CODE, B_CODE, I_CODE, W_CODE = 0, 1, 2, 3
IDLE = -1
"""The code of an idle step (``None`` in a row): it takes a turn and waits for nothing."""

FORWARD, GRADIENT = 0, 1
"""What a unit makes that others read: its forward output, its input gradient."""
MAKES = (FORWARD, GRADIENT, GRADIENT, None)
"""What each compute kind makes: F its output, B and I the input gradient, W nothing."""


def pack(key: int, kind: int) -> int:
    """The code of kind code ``kind`` on unit ``key``."""
    return key << 3 | kind


def unpack(code: int) -> tuple[int, int]:
    """``(key, kind code)`` of a packed action."""
    return code >> 3, code & 7


def encode(action: Action, num_microbatches: int) -> int:
    """The code of ``action`` (its stage and microbatch are not range-checked)."""
    stage, kind, microbatch = action
    return (stage * num_microbatches + microbatch) << 3 | KIND_CODE[kind]


def decode(code: int, num_microbatches: int) -> Action:
    """The :class:`Action` a code stands for."""
    stage, microbatch = divmod(code >> 3, num_microbatches)
    return tuple.__new__(Action, (stage, KINDS[code & 7], microbatch))


def columns(row: Sequence[int], num_microbatches: int) -> tuple[list[int], list[int]]:
    """``(stages, kind codes)`` of a row of codes, for loops that read both per action."""
    return [(c >> 3) // num_microbatches for c in row], [c & 7 for c in row]


# ----------------------------------------------------------------------------- the stage graph


class StageGraph(NamedTuple):
    """Which stage's forward output feeds which: ``before[s]`` are the stages stage ``s``
    reads, ``after[s]`` the stages that read it (the neighbour rule: nowhere else says "the
    next stage")."""

    before: tuple[tuple[int, ...], ...]
    after: tuple[tuple[int, ...], ...]


def chain(num_stages: int) -> tuple[tuple[int, int], ...]:
    """The edges of the plain pipeline, ``0 -> 1 -> ... -> num_stages - 1``."""
    return tuple((s, s + 1) for s in range(num_stages - 1))


def stage_graph(num_stages: int, edges=None, name: str = "custom") -> StageGraph:
    """The stage graph of ``edges`` (``Schedule.edges``; ``None``: the chain) over
    ``num_stages`` stages; ``name`` names the schedule in errors.

    :raises ScheduleError: an edge that names no stage of the schedule, a stage feeding itself,
        or a cycle (whose forwards could never start).
    """
    before: list[list[int]] = [[] for _ in range(num_stages)]
    after: list[list[int]] = [[] for _ in range(num_stages)]
    for edge in chain(num_stages) if edges is None else edges:
        src, dst = tuple(edge) if isinstance(edge, (tuple, list)) and len(edge) == 2 \
            else (None, None)
        if not all(type(s) is int and 0 <= s < num_stages for s in (src, dst)) or src == dst:
            raise ScheduleError(
                f"schedule {name!r}: edge {edge!r} must be a pair (from stage, to stage) of two "
                f"different stages in 0..{num_stages - 1}")
        if dst not in after[src]:
            after[src].append(dst)
            before[dst].append(src)
    if edges is not None:
        _refuse_cycles(name, before, after)
    return StageGraph(tuple(map(tuple, before)), tuple(map(tuple, after)))


def _refuse_cycles(name: str, before: list[list[int]], after: list[list[int]]) -> None:
    waiting = [len(b) for b in before]
    ready = [s for s, n in enumerate(waiting) if n == 0]
    for stage in ready:  # grows while it is read: Kahn's order
        for nxt in after[stage]:
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                ready.append(nxt)
    if len(ready) < len(before):
        cycle = sorted(set(range(len(before))) - set(ready))
        raise ScheduleError(f"schedule {name!r}: edges form a cycle through stages {cycle}; a "
                            f"stage can only read stages whose forwards do not need its own")


# ----------------------------------------------------------------------------- the rule


class Dependencies:
    """The dependency rule of one schedule, and the tables its clients read it from.

    The tables are per *place*: ``place = stage * K + slice`` with ``K = schedule.seq_chunks``
    and ``slice = key % K`` (a unit's microbatch index ``u`` numbers slice ``u % K`` of
    microbatch ``u // K``; :meth:`place`), so with ``K = 1`` a place is a stage.
    ``arrivals[kind][place]``: the inputs of an action made on another rank, as offsets from
    ``2 * key`` into an array with one entry per unit and thing made (``2 * key + FORWARD``,
    ``2 * key + GRADIENT``); the timed replays wait for them to arrive (an input made on the
    action's own rank ended before that rank got to it). ``wakes[kind][place]``: who reads what
    an action makes, as ``(code offset, rank)`` pairs (the walk's inverse of the rule).
    """

    def __init__(self, schedule: Schedule):
        self.graph = stage_graph(len(schedule.stage_ranks), schedule.edges, schedule.name)
        self.stage_ranks = tuple(schedule.stage_ranks)
        self.num_microbatches = M = schedule.num_microbatches
        self.seq_chunks = K = getattr(schedule, "seq_chunks", 1) or 1
        places = range(len(self.stage_ranks) * K)
        ranks = self.stage_ranks

        def delta(place: int, other: int) -> int:  # key of ``other``'s unit minus ``place``'s
            return (other // K - place // K) * M + other % K - place % K

        inputs = [[self.inputs(place, kind) for place in places] for kind in range(4)]
        self.arrivals = [[tuple(2 * delta(place, p) + made for p, made in found
                                if ranks[p // K] != ranks[place // K])
                          for place, found in enumerate(by_place)] for by_place in inputs]
        self._counts = [[len(inputs[kind][place]) for kind in range(4)] + [0] * 4
                        for place in places]
        wakes: list[list[list]] = [[[] for _ in places] for _ in range(8)]
        for kind, by_place in enumerate(inputs):  # invert: who reads what each action makes
            for place, found in enumerate(by_place):
                for p, made in found:
                    for maker in range(3):
                        if MAKES[maker] == made:
                            wakes[maker][p].append((delta(p, place) * 8 + kind - maker,
                                                    ranks[place // K]))
        self.wakes = [[tuple(w) for w in by_place] for by_place in wakes]

    def place(self, key: int) -> int:
        """The place (the tables' index) of unit ``key``: its stage when ``seq_chunks`` is 1."""
        K = self.seq_chunks
        return key // self.num_microbatches if K == 1 else \
            key // self.num_microbatches * K + key % K

    def inputs(self, place: int, kind: int) -> tuple[tuple[int, int], ...]:
        """What the action of kind code ``kind`` at ``place`` reads, as ``(place, FORWARD or
        GRADIENT)`` of the same microbatch: the dependency rule (module docstring). With
        ``seq_chunks`` 1 a place is a stage."""
        K = self.seq_chunks
        stage, piece = divmod(place, K)
        if kind == F_CODE:
            found = tuple((s * K + piece, FORWARD) for s in self.graph.before[stage])
            return found + ((place - 1, FORWARD),) if piece > 0 else found
        if kind == W_CODE:
            return ((place, GRADIENT),)
        after = self.graph.after[stage]
        found = tuple((s * K + piece, GRADIENT) for s in after) if after else \
            ((place, FORWARD),)
        return found + ((place + 1, GRADIENT),) if piece < K - 1 else found

    def missing(self) -> list[int]:
        """Per code, how many of the action's inputs are not made yet, before anything ran."""
        out: list[int] = []
        K = self.seq_chunks
        if K == 1:
            for counts in self._counts:
                out += counts * self.num_microbatches
            return out
        for stage in range(len(self.stage_ranks)):
            by_slice = self._counts[stage * K:(stage + 1) * K]
            out += [c for _ in range(self.num_microbatches // K) for counts in by_slice
                    for c in counts]
        return out


# ----------------------------------------------------------------------------- the walk

Visit = Callable[[int, int, int, int, int], object]
"""``visit(rank, code, key, stage, kind code)``: one ready action, as its code and the code's
parts; a true answer holds the rank."""


class Walk:
    """One run of the ready loop over ``rows``: per rank, the codes of its actions in order,
    :data:`IDLE` for an idle step (any negative code waits for nothing and reaches ``visit`` as
    ``(rank, code, -1, -1, -1)``). ``ptr[r]`` is how far rank ``r`` got.

    ``dependencies`` is the rule as tables: a :class:`Dependencies`, or anything with its
    ``num_microbatches``, ``missing()`` (per code, the inputs not yet made) and ``wakes``
    (``[kind][place]``, :meth:`Dependencies.place`: ``(code offset, rank)`` of each action that reads
    what this one makes) - torch's runtime, in :mod:`pp_core.schedule.torch_comms_check`, is
    one more such rule over the cells of a CSV file.
    """

    def __init__(self, rows: Sequence[Sequence[int]], dependencies: Dependencies):
        self.rows = rows
        self.dependencies = dependencies
        self.ptr = [0] * len(rows)
        self._missing = dependencies.missing()
        self._blocked = [False] * len(rows)
        self._queue = [r for r, row in enumerate(rows) if row]

    def wake(self, rank: int) -> None:
        """Offer ``rank``'s next action again at the next :meth:`run` (after a hold)."""
        self._queue.append(rank)

    def stuck(self) -> list[int]:
        """The ranks that have not run to the end of their rows."""
        return [r for r, row in enumerate(self.rows) if self.ptr[r] < len(row)]

    def run(self, visit: Visit | None = None, one_per_turn: bool = False) -> None:
        """Run each rank's actions in order as their inputs are made, handing each to
        ``visit``, until no rank can go on (:meth:`stuck` names the ranks left short).

        A true answer from ``visit`` holds the rank at that action, not run, until
        :meth:`wake` offers it again (a replay whose actions take time). ``one_per_turn``:
        torch's rounds (module docstring), where idle steps take a turn too.
        """
        rows, missing, wakes = self.rows, self._missing, self.dependencies.wakes
        ptr, blocked, M = self.ptr, self._blocked, self.dependencies.num_microbatches
        K = getattr(self.dependencies, "seq_chunks", 1)
        if one_per_turn:
            pop, push = heapq.heappop, heapq.heappush
        else:  # any order gives the same answer: a stack is the cheapest
            pop, push = list.pop, list.append
        current, later = self._queue, []
        while current:
            if one_per_turn:
                heapq.heapify(current)
            while current:
                r = pop(current)
                row = rows[r]
                p = ptr[r]
                n = len(row)
                end = p + 1 if one_per_turn and p < n else n
                while p < end:
                    c = row[p]
                    if c >= 0:
                        if missing[c] > 0:  # an input is not made yet: sleep until it is
                            blocked[r] = True
                            break
                        key = c >> 3
                        kind = c & 7
                        stage = key // M
                        if visit is not None and visit(r, c, key, stage, kind):
                            break
                        for offset, t in wakes[kind][stage if K == 1 else
                                                      stage * K + key % K]:
                            missing[c + offset] -= 1
                            if blocked[t]:
                                blocked[t] = False
                                if t > r:
                                    push(current, t)
                                else:
                                    later.append(t)
                    elif visit is not None:  # an idle step, or a client's own marker
                        visit(r, c, -1, -1, -1)
                    p += 1
                ptr[r] = p
                if p == end < n:
                    later.append(r)
            current, later = later, []
        self._queue = current
