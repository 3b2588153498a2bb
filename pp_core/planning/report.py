"""The ranking as a table a person reads: the top plans, the chosen one, what was given up."""

from __future__ import annotations

from pp_core.planning.choose import Candidate, Ranking
from pp_core.planning.sizes import format_bytes

__all__ = ["format_ranking", "describe", "ac_letters"]

_LETTER = {"none": "-", "selective": "s", "full": "f"}


def ac_letters(candidate: Candidate) -> str:
    """Activation checkpointing per stage, a letter each: ``f`` full, ``s`` selective, ``-``."""
    modes = candidate.stage_modes() or []
    return "".join(_LETTER.get(m, "?") for m in modes) or "-"


def describe(candidate: Candidate) -> str:
    """``zero_bubble, 1 stage/rank, 8 microbatches of 2``."""
    o = candidate.option
    per = "stage" if o.stages_per_rank == 1 else "stages"
    pool = ", receive-buffer pool on" if candidate.pool else ""
    modes = candidate.stage_modes() or []
    ac = "" if all(m == "none" for m in modes) else \
        f", activation checkpointing per stage {' '.join(modes)}"
    slices = f", {o.seq_chunks} sequence slices each" if o.seq_chunks > 1 else ""
    return (f"{o.schedule}, {o.stages_per_rank} {per}/rank, {o.num_microbatches} microbatches "
            f"of {o.microbatch_size}{slices}{pool}{ac}")


def _row(index, candidate: Candidate, slices: bool = False) -> str:
    o = candidate.option
    step = "-" if candidate.predicted_step_s is None else f"{candidate.predicted_step_s * 1e3:.1f}"
    bubble = "-" if candidate.bubble_ratio is None else f"{100 * candidate.bubble_ratio:.0f}%"
    per_rank = " ".join(format_bytes(m.total(candidate.pool)).replace(" ", "")
                        for m in candidate.memory)
    return (f"{index:>3}  {o.schedule:<18} {o.stages_per_rank:>2} {o.microbatch_size:>4} "
            f"{o.num_microbatches:>4} " + (f"{o.seq_chunks:>2} " if slices else "") +
            f"{step:>10} {bubble:>6}  {ac_letters(candidate):<8} "
            f"{per_rank}")


def format_ranking(ranking: Ranking, top: int = 8) -> str:
    """The top ``top`` plans that fit, the chosen one, and the faster plans that were dropped."""
    cap = "no memory cap" if ranking.memory_cap is None else \
        f"memory cap {format_bytes(ranking.memory_cap)} per rank"
    slices = any(c.option.seq_chunks > 1 for c in ranking.kept + ranking.dropped)
    lines = [f"{len(ranking.kept)} plans fit ({cap}), {len(ranking.dropped)} dropped; planned "
             f"in {ranking.planning_s:.2f} s",
             "  #  schedule            v  mbs    M " + (" K " if slices else "") +
             " step (ms) bubble  AC       predicted peak per rank"]
    lines += [_row(i + 1, c, slices) for i, c in enumerate(ranking.kept[:top])]
    if len(ranking.kept) > top:
        lines.append(f"     ... {len(ranking.kept) - top} more")
    if ranking.kept:
        best = ranking.kept[0]
        lines.append(f"chosen: {describe(best)}: predicted step {best.predicted_step_s * 1e3:.1f}"
                     f" ms, peak {format_bytes(best.peak_bytes)} per rank")
    gave_up = ranking.gave_up()
    if gave_up:
        lines.append("faster plans dropped:")
        for candidate in gave_up[:top]:
            lines.append(f"  {describe(candidate)}: predicted "
                         f"{candidate.predicted_step_s * 1e3:.1f} ms, {candidate.dropped}")
    refused = [c for c in ranking.dropped if c.predicted_step_s is None]
    if refused:
        lines.append(f"not possible ({len(refused)}): " + "; ".join(
            sorted({f"{c.option.schedule}: {c.dropped.split(';')[0]}" for c in refused})[:4]))
    if any(set(c.stage_modes() or ()) - {"none"} for c in ranking.kept[:top]):
        lines.append("AC: activation checkpointing per stage (f full, s selective, - none)")
    if slices:
        lines.append("K: sequence slices per microbatch (pipeline.pp_seq_chunks)")
    return "\n".join(lines)
