"""The run's schedule simulated with the action times it measured: the summary's simulated
bubble per rank, and ``output.schedule_image`` (a measured steady step above the simulated one).
"""

from __future__ import annotations

from pp_core.schedule.render import render_svg
from pp_core.schedule.run_picture import MeasuredRank, render_run_svg, steady_step, step_costs
from pp_core.schedule.simulate import Costs, simulate

__all__ = ["simulate_measured", "run_picture"]


def simulate_measured(schedule, ranks: list[dict]):
    """The simulator's run of ``schedule`` with this run's mean action costs (seconds), and
    the note saying which costs it used."""
    if schedule is None:
        return None, None

    per_stage: dict[int, dict[str, float]] = {}
    for figures in ranks:
        for key, value in figures["kind_times"].items():
            per_stage.setdefault(int(key[:-1]), {})[key[-1]] = value
    per_stage = {s: kinds for s, kinds in per_stage.items() if s < schedule.num_stages}
    if per_stage:
        costs = Costs(per_stage=per_stage)
        shown = ", ".join(f"stage {s}: " + " ".join(f"{k}={v * 1000:.1f}" for k, v in
                                                    sorted(per_stage[s].items()))
                          for s in sorted(per_stage))
        note = f"simulated with this run's mean action times in ms ({shown})"
    else:
        costs = Costs()
        note = "simulated with unit costs (F=1, B=2, I=1, W=1); per-action times not recorded"
    return simulate(schedule, costs), note


def run_picture(schedule, ranks: list[dict], start_step: int) -> str:
    """``output.schedule_image``: a steady step as measured on the first rank of each pipeline
    rank, above the same step simulated (:mod:`pp_core.schedule.run_picture`); the schedule
    simulated at unit costs when no action was timed."""
    firsts: dict[int, dict] = {}
    for figures in ranks:
        firsts.setdefault(figures["pp_rank"], figures)
    rows = [firsts[pp_rank] for pp_rank in sorted(firsts)]
    step = steady_step([figures["events"] for figures in rows])
    if step is None or not any(figures["kind_times"] for figures in rows):
        return render_svg(simulate(schedule))
    measured = [MeasuredRank(figures["rank"], [e[:4] for e in figures["events"]
                                               if e[4] == step]) for figures in rows]
    costs = {s: kinds for s, kinds in step_costs(measured).items() if s < schedule.num_stages}
    return render_run_svg(measured, simulate(schedule, Costs(per_stage=costs)),
                          start_step + step)
