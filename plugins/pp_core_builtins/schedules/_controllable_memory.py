"""The engine behind ``v_half`` and ``v_min`` (not a plugin: no hooks, no entry point).

Qi et al., "Pipeline Parallelism with Controllable Memory" (arXiv:2405.15362) build a V-placement
schedule from a repeated *building block*: the slots of ``F(c0), F(c1), I(c1), I(c0)`` of one
microbatch, repeated every 6 slots. Their procedure (sail-sg ``zbv_greedy.py``,
``PipelineGraph.create_schedule``), reimplemented here:

1. ``put_w``: every empty slot, in time order, takes a pending ``W``;
2. ``reorder``: take the passes in time order and move each to the earliest free slot after its
   dependencies that keeps the rank's memory within the pipeline's initial peak (F +1, I 0,
   W -1); the stable phase (from rank 0's first ``I(c0)`` to the first last-microbatch
   ``F(c0)``) is frozen; then squeeze (replay at unit cost, each pass as early as its
   dependencies allow);
3. drop the ``W``s and ``reorder`` again without them (memory then counts each ``W`` as run in
   the next empty slot), the warm-up frozen too;
4. ``put_w`` once more with one ``W`` queue per chunk (chunk 1 first); the per-rank time order is
   the schedule.

The sail-sg code rescans every rank at every step (quadratic). Here each step is linear: passes
are bucketed by time once, frozen passes are never visited (a free slot before the current pass
is exactly a slot no pass occupies now), a memory check looks only at the slots a move changes,
and the unit-cost squeeze is one pass over time buckets. The stable phase repeats with period one
microbatch (6 slots), so for ``m > 2p + 8`` the order for ``2p + 8`` microbatches is computed and
its stable stretch repeated; tests check both against each other and against worked examples
(tests/fixtures/reference_examples.py).
"""

from bisect import bisect_left
from itertools import accumulate

from pp_core import Action, F, I, ScheduleError, W

# Pass codes: 0 F(c0), 1 F(c1), 2 I(c1), 3 I(c0), 4 W (4 = W(c1), 5 = W(c0) when split).
_KIND_CHUNK = ((F, 0), (F, 1), (I, 1), (I, 0), (W, 1), (W, 0))
_DELTA = (1, 1, 0, 0, -1)


def controllable_memory_orders(pattern: list[list[int]], num_microbatches: int,
                               repeat_after: int | None = None) -> list[list[Action]]:
    """Per-rank orders for the building block ``pattern[r] = [slot of F(c0), F(c1), I(c1), I(c0)]``.

    Beyond ``repeat_after`` microbatches (default ``2p + 8``) the stable phase is repeated instead
    of computed; ``repeat_after=num_microbatches`` computes everything.
    """
    p, m = len(pattern), num_microbatches
    direct = min(m, 2 * p + 8 if repeat_after is None else repeat_after)
    slots = [[list(range(x, x + 6 * direct, 6)) for x in row] for row in pattern]
    slots = [row[:4] for row in _reorder(slots, with_w=True)]
    slots = [row[:4] for row in _reorder(slots, with_w=False)]
    orders = []
    for r, row in enumerate(slots):
        row = row + _put_w(row, split=True)
        order = [c for _, c in sorted((t, (code, k)) for code, ts in enumerate(row)
                                      for k, t in enumerate(ts))]
        stage = (r, 2 * p - 1 - r)
        kinds = [(stage[chunk], kind) for kind, chunk in _KIND_CHUNK]
        orders.append(_actions(order, kinds, m - direct))
    return orders


def _actions(order: list, kinds: list, extra: int) -> list[Action]:
    """The actions of ``order`` (pairs ``(code, microbatch)``), with ``extra`` more periods (6
    passes, one microbatch later each) repeated in the stable phase: at the start of the longest
    stretch where every pass recurs 6 positions later for the next microbatch."""
    make = Action._make
    if not extra:
        return [make((*kinds[c], k)) for c, k in order]
    best = run = start = cut = 0
    for i in range(len(order) - 6):
        (a, k), (b, k2) = order[i], order[i + 6]
        run = run + 1 if a == b and k2 == k + 1 else 0
        if run == 1:
            start = i
        if run > best:
            best, cut = run, start
    if best < 6:
        raise ScheduleError("pp_core_builtins.schedules._controllable_memory found no stable "
                            "phase to repeat; this is a bug, please report it with the "
                            "schedule's sizes")
    period = [(*kinds[c], k) for c, k in order[cut:cut + 6]]
    out = [make((*kinds[c], k)) for c, k in order[:cut]]
    for j in range(extra):
        out += [make((s, kind, k + j)) for s, kind, k in period]
    out += [make((*kinds[c], k + extra)) for c, k in order[cut:]]
    return out


def _put_w(lists: list[list[int]], split: bool) -> list[list[int]]:
    """W slots of one rank: each empty slot takes a pending W (chunk 1's first when split)."""
    bound = max(ts[-1] for ts in lists)
    cells = bytearray(bound + 1)  # pass code + 1 at each occupied slot, 0 when empty
    for code, ts in enumerate(lists):
        for t in ts:
            cells[t] = code + 1
    w1, w0, pending1, pending0 = [], [], 0, 0
    for t, cell in enumerate(cells):
        if cell == 4 and split:  # I(c0)
            pending0 += 1
        elif cell >= 3:  # I(c1), or any I without split
            pending1 += 1
        elif not cell:
            if pending1:
                w1.append(t)
                pending1 -= 1
            elif pending0:
                w0.append(t)
                pending0 -= 1
    w1 += range(bound + 1, bound + 1 + pending1)
    w0 += range(bound + 1 + pending1, bound + 1 + pending1 + pending0)
    return [w1, w0] if split else [w1]


def _reorder(slots: list[list[list[int]]], with_w: bool) -> list[list[list[int]]]:
    """One ``reorder`` + squeeze (step 2 with ``with_w``, else step 3); returns start times."""
    n, m = len(slots), len(slots[0][0])
    if with_w:
        slots = [row + _put_w(row, split=False) for row in slots]
    busy, level, queue = [], [], []  # per rank: code+1 at each slot; memory (and W queue) after it
    for row in slots:
        b = bytearray(max(ts[-1] for ts in row) + 1)
        for code, ts in enumerate(row):
            for t in ts:
                b[t] = code + 1
        busy.append(b)
        if with_w:
            level.append(list(accumulate(_DELTA[c - 1] if c else 0 for c in b)))
        else:
            lv, qu, cur, pending = [], [], 0, 0
            for c in b:
                if c:
                    cur += c <= 2
                    pending += c > 2
                elif pending:
                    cur, pending = cur - 1, pending - 1
                lv.append(cur)
                qu.append(pending)
            level.append(lv)
            queue.append(qu)
    cap = max(max(lv) for lv in level)
    # Frozen: from rank 0's first I(c0) to the first last-microbatch F(c0) after it (inclusive);
    # without W also everything before. Keys (time, rank, code, microbatch) give the order.
    first_i0 = slots[0][3][0]
    last_f0 = min(((row[0][m - 1], r, 0, m - 1) for r, row in enumerate(slots)
                   if (row[0][m - 1], r) > (first_i0, 0)), default=None)
    todo = []
    for r, row in enumerate(slots):
        for code, ts in enumerate(row):
            todo += [(ts[k], r, code, k) for k in range(bisect_left(ts, first_i0) if with_w else 0)]
            if last_f0:
                todo += [(ts[k], r, code, k) for k in range(bisect_left(ts, last_f0[0]), len(ts))
                         if (ts[k], r, code, k) > last_f0]
    todo.sort()
    for t0, r, code, k in todo:
        row, b, lv = slots[r], busy[r], level[r]
        ready = -1
        if code in (0, 2) and r > 0:
            ready = slots[r - 1][code][k]
        elif code in (1, 3) and r + 1 < n:
            ready = slots[r + 1][code][k]
        if 0 < code < 4:
            ready = max(ready, row[code - 1][k])
        if code == 4:  # the k-th I of this rank, in time order
            ready = max(ready, _kth(row[2], row[3], k))
        if k:
            ready = max(ready, row[code][k - 1])
        new = b.find(0, ready + 1, t0)  # the earliest free slot, or -1
        if not with_w:
            while new >= 0 and not _try_move(b, lv, queue[r], code, new, t0, cap):
                new = b.find(0, new + 1, t0)
        elif code <= 1 and new >= 0 and max(lv[new:t0]) >= cap:
            # An F raises memory on [new, t0): it may only go after the last slot at the cap.
            tail = lv[new:t0]
            tail.reverse()
            new = b.find(0, t0 - tail.index(cap), t0)
        if new < 0:
            continue
        if code <= 1 and with_w:
            lv[new:t0] = [x + 1 for x in lv[new:t0]]
        elif code == 4:
            lv[new:t0] = [x - 1 for x in lv[new:t0]]
        b[new], b[t0], row[code][k] = code + 1, 0, new
    if not with_w:
        slots = [row + _put_w(row, split=False) for row in slots]
    return _squeeze(slots)


def _try_move(b: bytearray, lv: list, qu: list, code: int, new: int, old: int, cap: int) -> bool:
    """Without W: would moving pass ``code`` from ``old`` to ``new`` keep memory <= cap? If so,
    record the new memory levels (replaying until they agree with the old ones again)."""
    cur, pending = (lv[new - 1], qu[new - 1]) if new else (0, 0)
    changed = []
    for t in range(new, len(b)):
        c = code + 1 if t == new else 0 if t == old else b[t]
        if c:
            cur += c <= 2
            pending += c > 2
        elif pending:
            cur, pending = cur - 1, pending - 1
        if cur > cap:
            return False
        if t > old and cur == lv[t] and pending == qu[t]:
            break
        changed.append((cur, pending))
    for t, (level, queued) in enumerate(changed, start=new):
        lv[t], qu[t] = level, queued
    return True


def _kth(a: list[int], b: list[int], k: int) -> int:
    """The ``k``-th smallest (from 0) of two sorted lists of distinct numbers."""
    take = k + 1
    lo, hi = max(0, take - len(b)), min(take, len(a))
    while lo < hi:
        i = (lo + hi) // 2
        if a[i] < b[take - i - 1]:
            lo = i + 1
        else:
            hi = i
    return max(a[lo - 1] if lo else -1, b[take - lo - 1] if take - lo else -1)


def _squeeze(slots: list[list[list[int]]]) -> list[list[list[int]]]:
    """Unit-cost replay in time order: each pass starts when its inputs and its rank are free."""
    n = len(slots)
    buckets = [[] for _ in range(1 + max(ts[-1] for row in slots for ts in row if ts))]
    for r, row in enumerate(slots):
        for code, ts in enumerate(row):
            for k, t in enumerate(ts):
                buckets[t].append((r, code, k))
    end = [[[0] * len(ts) for ts in row] for row in slots]
    free = [0] * n
    for bucket in buckets:
        for r, code, k in bucket:
            mine = end[r]
            start = free[r]
            if code == 0 or code == 2:
                if r and end[r - 1][code][k] > start:
                    start = end[r - 1][code][k]
            elif code != 4 and r + 1 < n and end[r + 1][code][k] > start:
                start = end[r + 1][code][k]
            if 0 < code < 4 and mine[code - 1][k] > start:
                start = mine[code - 1][k]
            if k and mine[code][k - 1] > start:
                start = mine[code][k - 1]
            mine[code][k] = free[r] = start + 1
    return [[[t - 1 for t in ts] for ts in row] for row in end]
