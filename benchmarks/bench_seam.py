"""What the executor's per-action seam costs: observers and the ``PP:`` profiler records.

One process, every stage local (no communication, so the executor's own per-action work is as
large a share of a step as it gets), a small MLP split in 2 stages (interleaved 1F1B on one
rank), 32 microbatches: 128 actions per step. Modes, alternated step by step so that drift on a
shared machine hits them alike:

* ``plain`` - no observer, no profiler (every run of ``pp-core`` without tracing);
* ``observer`` - one do-nothing :class:`~pp_core.runtime.observers.ActionObserver`;
* ``timer`` - the run recorder's :class:`~pp_core.app.rank.timing.ActionTimer`;
* ``profiler`` - inside ``torch.profiler.profile()`` (a ``PP:`` record per action; for scale).

Each mode's cost is the median over rounds of (mode's step / plain step of the same round).

Also ``record_function`` entered and left with no profiler on, per call: what wrapping every
action unconditionally would cost, which is why the executor checks for a profiler first.

    python benchmarks/bench_seam.py [--steps 60] [--width 64] [--json out.json]

``--modes plain`` runs only the plain mode, which older versions (without observers) can run too.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from torch import nn
from _common import options, write_json

MODES = ("plain", "observer", "timer", "profiler")


def make_pipe(width: int, microbatches: int):
    from pp_core import PipelineConfig, build_pipeline

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))
    config = PipelineConfig(pp_schedule="interleaved_1f1b", pp_batch_size=2 * microbatches,
                            pp_microbatch_size=2,
                            loss_fn=lambda out, target: ((out - target) ** 2).mean())
    return build_pipeline(model, config)


def step_seconds(pipe, mode: str, x, y) -> float:
    """CPU seconds of one step (the process's, one torch thread): the seam's cost is host work,
    and CPU time does not count the time slices other processes take on a shared machine."""
    start = time.process_time()
    if mode == "profiler":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            pipe.step(x, target=y)
    else:
        pipe.step(x, target=y)
    return time.process_time() - start


def record_function_us(calls: int = 20000) -> float:
    start = time.process_time()
    for _ in range(calls):
        with torch.profiler.record_function("PP:0F0"):
            pass
    return (time.process_time() - start) / calls * 1e6


def seam_micro_us(calls: int = 50000) -> dict:
    """The seam's own host cost, apart from the step (whose noise on a shared machine is larger):
    per step when unused (the profiler check and the end-of-step wait call), per action with one
    do-nothing observer (``run_action`` against calling the handler directly)."""
    from pp_core._torch_compat import profiler_enabled
    from pp_core.runtime.observers import ActionObserver, run_action, waiting
    from pp_core.schedule.ir import F, Action

    def handler(executor, state, action):
        pass

    def per_call(body) -> float:
        start = time.process_time()
        body()
        return (time.process_time() - start) / calls * 1e6

    action, observers = Action(0, F, 0), [ActionObserver()]

    def direct():
        for _ in range(calls):
            handler(None, None, action)

    def observed():
        for _ in range(calls):
            run_action(handler, None, None, action, observers, False)

    def unused():
        for _ in range(calls):
            profiler_enabled()
            waiting([], None, handler, None, None, None)

    base = per_call(direct)
    return {"unused_per_step_us": round(per_call(unused) - base, 3),
            "one_observer_per_action_us": round(per_call(observed) - base, 3)}


def observe(pipe, mode: str):
    """Register the observer ``mode`` measures (``None`` for plain and profiler)."""
    if mode == "observer":
        from pp_core.runtime.observers import ActionObserver

        observer = ActionObserver()
        pipe.add_action_observer(observer)
        return observer
    if mode == "timer":
        from pp_core.app.rank.timing import ActionTimer

        timer = ActionTimer(torch.device("cpu"))
        pipe.add_action_observer(timer)
        return timer
    return None


def run(steps: int, width: int, microbatches: int, modes) -> dict:
    torch.set_num_threads(1)
    pipe = make_pipe(width, microbatches)
    x, y = torch.randn(2 * microbatches, width), torch.randn(2 * microbatches, width)
    actions = len(pipe._train.program.actions)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for index in range(steps + 3):
        shift = index % len(modes)  # each mode in turn follows each other one
        for mode in modes[shift:] + modes[:shift]:
            observer = observe(pipe, mode)
            seconds = step_seconds(pipe, mode, x, y)
            if observer is not None:
                pipe.remove_action_observer(observer)
            if index >= 3:  # warm-up steps are not counted
                times[mode].append(seconds)
    report = {"steps": steps, "actions_per_step": actions, "width": width,
              "microbatches": microbatches, "modes": {}}
    plain = times.get("plain")
    for mode in modes:
        median = statistics.median(times[mode])
        row = {"median_ms": round(median * 1e3, 3), "min_ms": round(min(times[mode]) * 1e3, 3)}
        if plain is not None and mode != "plain":
            # per round (the modes ran back to back): robust to drift of the machine's load
            ratios = [t / p for t, p in zip(times[mode], plain)]
            extra = [(t - p) / actions * 1e6 for t, p in zip(times[mode], plain)]
            row["vs_plain"] = round(statistics.median(ratios), 3)
            row["per_action_us"] = round(statistics.median(extra), 2)
        report["modes"][mode] = row
    report["record_function_no_profiler_us"] = round(record_function_us(), 2)
    if "observer" in modes:  # needs the seam (older versions run --modes plain only)
        report["seam_micro"] = seam_micro_us()
    return report


def main(argv=None) -> None:
    args = options(__doc__, steps=60, width=64, microbatches=32, modes=",".join(MODES),
                   json=None).parse_args(argv)
    report = run(args.steps, args.width, args.microbatches, list(args.modes.split(",")))
    print(json.dumps(report, indent=2))
    write_json(args.json, report, indent=2)
    print(f"\n{report['actions_per_step']} actions per step, median of {args.steps} steps (CPU time)")
    print(f"{'mode':<10} {'CPU ms':>9} {'min ms':>8} {'x plain':>8} {'us/action':>10}")
    for mode, row in report["modes"].items():
        print(f"{mode:<10} {row['median_ms']:>9.3f} {row['min_ms']:>8.3f} "
              f"{row.get('vs_plain', 1.0):>8.3f} {row.get('per_action_us', 0.0):>10.2f}")
    print(f"record_function with no profiler: {report['record_function_no_profiler_us']} us/call")
    micro = report.get("seam_micro")
    if micro:
        print(f"seam unused: {micro['unused_per_step_us']} us/step; one do-nothing observer: "
              f"{micro['one_observer_per_action_us']} us/action")


if __name__ == "__main__":
    main()
