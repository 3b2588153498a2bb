"""Lowering: SEND/RECV insertion, the per-pair order NCCL needs, lifetimes, speed, refusals."""

from __future__ import annotations


import pytest
from tests.cases.calls import count_calls

from pp_core import Action, B, F, I, ScheduleError, W
from pp_core.schedule.build import build_schedule
from pp_core.schedule.ir import RECV_B, RECV_F, SEND_B, SEND_F, Schedule, stage_to_rank
from pp_core.schedule.lower import RecvLifetime, forward_only, lower

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "dfs", "zero_bubble", "zb_h2",
             "v_schedule", "v_half", "v_min", "dualpipe_v"]
CASES = [(name, p, m) for name in SCHEDULES for p in (2, 4) for m in (2 * p, 3 * p)]


def schedule_for(name, p, m):
    return build_schedule(name, num_ranks=p, num_microbatches=m)


def one_f_one_b(p: int, m: int) -> Schedule:
    rows = []
    for r in range(p):
        warmup = min(m, p - r - 1)
        row = [Action(r, F, k) for k in range(warmup)]
        f = warmup
        for b in range(m):
            if f < m:
                row.append(Action(r, F, f))
                f += 1
            row.append(Action(r, B, b))
        rows.append(row)
    return Schedule(rows, tuple(range(p)), m, "1f1b")


def looped_bfs_split(p: int, v: int, m: int) -> Schedule:
    """Every forward per local stage, then I/W backwards: big, valid, cheap to build."""
    rows = []
    for r in range(p):
        stages = [r + i * p for i in range(v)]
        row = [Action(s, F, k) for s in stages for k in range(m)]
        row += [a for s in reversed(stages) for k in reversed(range(m))
                for a in (Action(s, I, k), Action(s, W, k))]
        rows.append(row)
    return Schedule(rows, stage_to_rank("loop", p * v, p), m, "bfs_split")


def test_lower_1f1b_two_ranks_exact():
    program = lower(one_f_one_b(2, 3))
    assert program.rows() == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2",
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1RECV_F2 1B1 1SEND_B1 1F2 1B2 1SEND_B2",
    ]
    assert program.rank(1).recv_lifetimes[0] == RecvLifetime(Action(1, RECV_F, 0), 0, 1, 3)


@pytest.mark.parametrize("name,p,m", CASES)
def test_lower_equals_torch_add_send_recv(name, p, m):
    """Same programs as torch 2.13's _add_send_recv (whose quadratic loop we replace)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    schedule = schedule_for(name, p, m)

    def to_torch(a):
        return None if a is None else schedules._Action(
            a.stage, schedules._ComputationType.from_str(a.kind.value), a.microbatch)

    compute = {r: [to_torch(a) for a in row] for r, row in enumerate(schedule.actions)}
    theirs = schedules._add_send_recv(compute, lambda s: schedule.stage_ranks[s],
                                      schedule.num_stages)
    assert lower(schedule).rows() == [" ".join(map(str, theirs[r])) for r in range(p)]


def _messages(program):
    """Per rank: the messages of its SEND/RECV actions in program order, as (src, dst, id)."""
    ranks = program.stage_ranks
    per_rank = []
    for rank, row in enumerate(program.actions):
        seen = []
        for a in row:
            if a.kind is SEND_F:
                seen.append((rank, ranks[a.stage + 1], ("F", a.stage, a.microbatch)))
            elif a.kind is RECV_F:
                seen.append((ranks[a.stage - 1], rank, ("F", a.stage - 1, a.microbatch)))
            elif a.kind is SEND_B:
                seen.append((rank, ranks[a.stage - 1], ("B", a.stage, a.microbatch)))
            elif a.kind is RECV_B:
                seen.append((ranks[a.stage + 1], rank, ("B", a.stage + 1, a.microbatch)))
        per_rank.append(seen)
    return per_rank


@pytest.mark.parametrize("name,p,m", CASES)
def test_lower_edges_and_pair_order(name, p, m):
    """One SEND and one RECV per cross-rank edge, none within a rank, and for every pair of
    ranks both programs list their messages in the same order (NCCL matches in order)."""
    schedule = schedule_for(name, p, m)
    program = lower(schedule)
    ranks = schedule.stage_ranks
    expected = {("F", s, k) for s in range(schedule.num_stages - 1) for k in range(m)
                if ranks[s] != ranks[s + 1]}
    expected |= {("B", s, k) for s in range(1, schedule.num_stages) for k in range(m)
                 if ranks[s] != ranks[s - 1]}
    messages = _messages(program)
    sent = [msg for rank, row in enumerate(messages) for (src, dst, msg) in row if src == rank]
    assert sorted(sent) == sorted(expected)
    for a in range(p):
        for b in range(a + 1, p):
            on_a = [msg for src, dst, msg in messages[a] if {src, dst} == {a, b}]
            on_b = [msg for src, dst, msg in messages[b] if {src, dst} == {a, b}]
            assert on_a == on_b, f"ranks {a} and {b} disagree on their message order"


def replay(program, visit) -> list[int]:
    """Run every rank's program under runtime semantics - a RECV posts, a SEND completes at
    once, a compute blocks until its message was sent - calling ``visit(rank, position,
    action, ptr)`` before each action that runs; returns how far each rank got."""
    rows, p = program.actions, program.num_ranks
    ptr = [0] * p
    sent = set()
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while ptr[rank] < len(rows[rank]):
                a = rows[rank][ptr[rank]]
                if a.kind is F and a.stage and program.stage_ranks[a.stage - 1] != rank \
                        and ("F", a.stage - 1, a.microbatch) not in sent:
                    break
                if a.kind in (B, I) and a.stage < program.num_stages - 1 \
                        and program.stage_ranks[a.stage + 1] != rank \
                        and ("B", a.stage + 1, a.microbatch) not in sent:
                    break
                visit(rank, ptr[rank], a, ptr)
                if a.kind in (SEND_F, SEND_B):
                    sent.add(("F" if a.kind is SEND_F else "B", a.stage, a.microbatch))
                ptr[rank] += 1
                progress = True
    return ptr


@pytest.mark.parametrize("name,p,m", CASES)
def test_lower_runs_to_completion_under_runtime_semantics(name, p, m):
    """Replayed, every rank reaches its end (no deadlock), and each consumer follows its
    RECV."""
    program = lower(schedule_for(name, p, m))
    posted = set()

    def visit(rank, position, a, ptr):
        if a.kind is F and a.stage and program.stage_ranks[a.stage - 1] != rank:
            assert ("RF", a.stage, a.microbatch) in posted
        if a.kind in (B, I) and a.stage < program.num_stages - 1 \
                and program.stage_ranks[a.stage + 1] != rank:
            assert ("RB", a.stage, a.microbatch) in posted
        if a.kind in (RECV_F, RECV_B):
            posted.add(("RF" if a.kind is RECV_F else "RB", a.stage, a.microbatch))

    assert replay(program, visit) == [len(row) for row in program.actions]


@pytest.mark.parametrize("name,p,m", CASES[::3])
def test_lower_lifetimes_point_at_their_actions(name, p, m):
    program = lower(schedule_for(name, p, m))
    for rank in range(p):
        rp = program.rank(rank)
        recvs = [i for i, a in enumerate(rp.actions) if a.kind in (RECV_F, RECV_B)]
        assert [lt.posted for lt in rp.recv_lifetimes] == recvs
        for lt in rp.recv_lifetimes:
            stage, kind, mb = lt.action
            assert rp.actions[lt.posted] == lt.action
            assert lt.posted < lt.consumed <= lt.released
            consumer = rp.actions[lt.consumed]
            assert (consumer.stage, consumer.microbatch) == (stage, mb)
            assert consumer.kind in ((F,) if kind is RECV_F else (B, I))
            last = rp.actions[lt.released]
            assert (last.stage, last.microbatch) == (stage, mb) and last.kind in (B, W)
            later = [a for a in rp.actions[lt.released + 1:]
                     if (a.stage, a.microbatch) == (stage, mb) and a.kind in (B, I, W)]
            assert not later, "released must be the last backward of (stage, microbatch)"


def test_lower_v_placement_hands_off_locally():
    schedule = schedule_for("v_schedule", 2, 4)  # stages 1 and 2 both live on rank 1
    program = lower(schedule)
    row = program.actions[1]
    assert not [a for a in row if a.kind in (SEND_F, SEND_B, RECV_F, RECV_B)
                and (a.kind, a.stage) in ((SEND_F, 1), (RECV_F, 2), (SEND_B, 2), (RECV_B, 1))]


def test_forward_only_program():
    program = lower(forward_only(schedule_for("1f1b", 2, 4)))
    assert program.rows()[1] == "1RECV_F0 1F0 1RECV_F1 1F1 1RECV_F2 1F2 1RECV_F3 1F3"
    assert all(lt.released == lt.consumed for lt in program.rank(1).recv_lifetimes)


def test_lower_is_linear_time():
    """Four times the microbatches cost about four times the work (torch's quadratic lowering
    costs sixteen). Counted in function calls, not seconds, so a loaded machine cannot fail it;
    benchmarks/bench_runtime.py reports the time (~0.5 s at pp=64, 1024 microbatches)."""
    small = count_calls(lower, looped_bfs_split(8, 2, 32))
    large = count_calls(lower, looped_bfs_split(8, 2, 128))
    assert 3.0 < large / small < 5.0, (small, large)


def test_lower_refuses_cycles_with_the_waiting_actions():
    rows = [[Action(0, F, 0), Action(0, B, 0)], [Action(1, B, 0), Action(1, F, 0)]]
    with pytest.raises(ScheduleError, match=r"rank 1 waits at 1B0.*rank 0 waits at 0B0|"
                                            r"rank 0 waits at 0B0; rank 1 waits at 1B0"):
        lower(Schedule(rows, (0, 1), 1, "cyclic"))


def test_lower_refuses_misplaced_and_comm_actions():
    rows = [[Action(1, F, 0)], [Action(0, F, 0)]]
    with pytest.raises(ScheduleError, match=r"rank 0: 1F0 belongs to stage 1, which lives on rank 1"):
        lower(Schedule(rows, (0, 1), 1))
    rows = [[Action(0, SEND_F, 0)], []]
    with pytest.raises(ScheduleError, match="compute-only"):
        lower(Schedule(rows, (0, 1), 1))
    rows = [[Action(0, F, 3)], []]
    with pytest.raises(ScheduleError, match="out of range"):
        lower(Schedule(rows, (0, 1), 1))


def test_send_acks_1f1b_two_ranks_exact():
    """A forward output is known received when its gradient arrives (rank 0 at each B); a
    gradient when the upstream rank's next message after its backward does (rank 1's first
    gradient at F2; the last ones have no later message and wait for the step's end)."""
    program = lower(one_f_one_b(2, 3))
    assert program.send_acks(0) == {5: (1,), 9: (3,), 11: (7,)}
    assert program.send_acks(1) == {9: (4,)}


@pytest.mark.parametrize("name,p,m", CASES)
def test_send_acks_only_name_sends_the_peer_has_consumed(name, p, m):
    """Replay every rank in the lowering's global order: wherever a rank settles a send, the
    peer has already run the compute that consumes it, so the wait cannot block."""
    program = lower(schedule_for(name, p, m))
    rows = program.actions
    consumer = {}  # (receiving rank, RECV action) -> position of the compute that reads it
    for rank in range(p):
        for lt in program.rank(rank).recv_lifetimes:
            consumer[rank, lt.action] = lt.consumed
    acks = [program.send_acks(rank) for rank in range(p)]
    assert any(acks), "some send must be known received before the step's end"

    def visit(rank, at, a, ptr):
        for position in acks[rank].get(at, ()):
            send = rows[rank][position]
            assert position < at and send.kind in (SEND_F, SEND_B)
            target = (Action(send.stage + 1, RECV_F, send.microbatch) if send.kind is SEND_F
                      else Action(send.stage - 1, RECV_B, send.microbatch))
            peer = program.stage_ranks[target.stage]
            assert ptr[peer] > consumer[peer, target], (rank, send, ptr)

    assert replay(program, visit) == [len(row) for row in rows]
