"""When a rank may forget what it sent: the program positions that prove a send received.

Why: gloo never reports a send complete until it is waited for (``Work.is_completed()`` stays
``False``), so a runtime that only reaps completed sends keeps every tensor it sent alive until
the step's end - a stage's outputs well past their backward, 65-200 KB per rank of a small
2-rank pipeline. Waiting for a send is safe only where the peer has certainly received it.

The proof is causal and per pair of ranks, from the lowered programs alone: rank ``r`` sent
``m`` to ``p``; ``p`` consumed ``m`` at its compute action ``c``; any message ``p`` sent ``r``
after ``c`` in its program, once ``r`` has consumed it, proves ``m`` received. So a forward
output is known received when the gradient for it arrives; a gradient, when the upstream
rank's next message after its backward does. Waiting there cannot deadlock: in the lowering's
global order the peer reached ``c`` before it emitted the message just consumed. torch 2.15's
own lowering waits a forward send at the same point.
"""

from __future__ import annotations

import bisect

from pp_core.schedule.ir import RECV_B, RECV_F, SEND_B, SEND_F, Action
from pp_core.schedule.replay import stage_graph

__all__ = ["send_acks"]


def send_acks(program, rank: int) -> dict[int, tuple[int, ...]]:
    """``{position: positions of SENDs}`` for ``rank`` of a lowered ``program``: once the
    compute action at ``position`` has waited for its input, the listed sends have been
    received, so waiting for them returns at once and frees the tensors they hold."""
    stage_ranks = program.stage_ranks
    graph = stage_graph(len(stage_ranks), program.edges, program.name)
    # where a stage's SEND_F / SEND_B goes: the stage after / before it on another rank
    towards = {SEND_F: ([(s, RECV_F) for s in after if stage_ranks[s] != stage_ranks[stage]]
                        for stage, after in enumerate(graph.after)),
               SEND_B: ([(s, RECV_B) for s in before if stage_ranks[s] != stage_ranks[stage]]
                        for stage, before in enumerate(graph.before))}
    towards = {kind: [found[0] if found else None for found in stages]
               for kind, stages in towards.items()}

    def consumed(r: int) -> dict[Action, int]:  # RECV -> the compute that reads it
        return {lt.action: lt.consumed for lt in program.rank(r).recv_lifetimes
                if lt.consumed >= 0}

    def sends(r: int):  # (position, peer, the matching RECV) per SEND of r
        for position, a in enumerate(program.rank(r).actions):
            if a.kind is SEND_F or a.kind is SEND_B:
                stage, recv = towards[a.kind][a.stage]
                yield position, stage_ranks[stage], Action(stage, recv, a.microbatch)

    mine = consumed(rank)
    by_peer: dict[int, list] = {}
    for position, peer, recv in sends(rank):
        by_peer.setdefault(peer, []).append((position, recv))
    acks: dict[int, list[int]] = {}
    for peer, outgoing in by_peer.items():
        theirs = consumed(peer)
        # the peer's sends to this rank in its program order, each with the earliest point at
        # which this rank has consumed that message or a later one
        back = [(q, mine.get(recv, -1)) for q, to, recv in sends(peer) if to == rank]
        earliest, soonest = [0] * len(back), -1
        for i in range(len(back) - 1, -1, -1):
            c = back[i][1]
            soonest = c if soonest < 0 or 0 <= c < soonest else soonest
            earliest[i] = soonest
        positions = [q for q, _ in back]
        for position, recv in outgoing:
            received = theirs.get(recv)
            if received is None:
                continue
            i = bisect.bisect_right(positions, received)
            if i < len(back) and earliest[i] > position:
                acks.setdefault(earliest[i], []).append(position)
    return {at: tuple(listed) for at, listed in acks.items()}
