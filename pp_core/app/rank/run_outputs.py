"""Everything a run leaves behind: metrics lines, the Chrome trace, the schedule image, the summary.

:class:`RunRecorder` lives on every rank. It times each pipeline step (and each action, when the
executor reports per-action times), writes one JSON object per logged step to
``output.metrics`` on the first rank, and at the end gathers every rank's figures there to write
the trace of the real run (one process row per rank, one event per action or step), the SVG of the
schedule, and the summary table: measured bubble per rank next to what the simulator predicts
for the same schedule with the per-action costs this run measured.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from pp_core.app.rank.output_files import MetricsFile, write_output
from pp_core.app.rank.progress import format_summary
from pp_core.app.rank.saved import gather_saved_peaks
from pp_core.app.rank.timing import ActionTimer, StepTotals, peak_memory
from pp_core.devices import cpu_cores
from pp_core.app.rank.simulated import run_picture, simulate_measured
from pp_core.schedule.labels import KINDS, WAIT, category
from pp_core.schedule.trace import run_trace, write_json

__all__ = ["RunRecorder"]

TRACE_STEPS = 20  # the trace keeps the last this-many steps (a long run's trace stays small)
SLOW_FACTOR, SLOW_AFTER_STEPS = 3.0, 3  # a step this much slower than the mean is counted

logger = logging.getLogger(__name__)


def describe_mesh(mesh) -> str:
    """``pp 2 x dp_replicate 1 x dp_shard 1 x tp 2`` for a named device mesh."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return " x ".join(f"{name} {mesh.size(i)}" for i, name in enumerate(names))


class RunRecorder:
    """Per-rank bookkeeping of a run; only the first rank writes files and prints."""

    def __init__(self, spec, ctx, pipe, num_params: int):
        self.spec, self.ctx, self.pipe, self.num_params = spec, ctx, pipe, num_params
        self.rank = ctx.rank
        self.progress = None
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.step_times: list[float] = []
        self.tokens_per_s: list[float] = []
        self.data_figures: list[dict] = []  # per step: valid tokens/s, padding, docs (data_metrics)
        self.eval_loss: float | None = None
        self.events: list[tuple] = []  # (name, category, start, end, step), last TRACE_STEPS
        # Running figures, in space that does not grow with the run (a long run would otherwise
        # keep every action's time): the step totals of the first step apart (it pays for
        # warm-up) and of the later ones, and per "<stage><kind>" the sum and count of times.
        self.first_totals: StepTotals | None = None
        self.steady_totals = StepTotals()
        self.kind_times: dict[str, list[float]] = {}  # "<stage><kind>" -> [seconds, count]
        self.clock_offset = time.time() - time.perf_counter()
        self.slow_steps: list[tuple[int, float, float]] = []  # (step, seconds, x the mean)
        self.tokens_per_step = 0
        self.saved_max = 0  # this rank's most peak_saved_bytes over the run (runtime/saved_bytes)
        self.timer = ActionTimer(ctx.device)
        self.plugins = pipe.plugins
        self.metrics = None  # opened by open_metrics once the first step is known
        self.attempts = None  # pp_core.app.restarts.Attempts: the account of restarts
        self.checkpoints = None  # pp_core.app.rank.saving.Checkpoints: the time saves took
        self.tensorboard = None
        if spec.output.tensorboard and self.rank == 0:  # a pp_report_metrics sink
            from pp_core.app.rank.data_metrics import TensorBoardSink  # lazy: tensorboard

            self.tensorboard = TensorBoardSink(spec.output.tensorboard)
            self.plugins.pm.register(self.tensorboard, name="pp_core.tensorboard")

    def say(self, text: str) -> None:
        if self.rank != 0:
            return
        if self.progress is not None:
            self.progress.message(text)
        else:
            print(text, flush=True)

    def open_metrics(self, start_step: int) -> None:
        """Open ``output.metrics`` on the first rank for a run that continues after
        ``start_step``: the lines of later steps (a resumed run is about to write them again)
        are dropped, so every step appears once; a fresh run starts an empty file."""
        path = self.spec.output.metrics
        if path and self.rank == 0:
            self.metrics = MetricsFile(path, start_step)

    def note_restart(self, recovery: dict | None) -> None:
        """After a restart's first step: a metrics line for it (under the step it resumed from,
        so a later resume keeps it) and the progress line says it from then on."""
        if recovery is None or self.rank != 0:
            return
        if self.metrics:
            self.metrics.write({"step": recovery["resumed_from"], "event": "restart", **recovery,
                                "layout": self.spec.dims.describe()})
        if self.progress is not None:
            self.progress.suffix = f"  restarts {recovery['restart']}"
        self.say(f"restart {recovery['restart']}: the first step after it completed "
                 f"{recovery['recovery_s']:.1f} s after the last one before the failure")

    # ------------------------------------------------------------------ per step

    def timed_step(self, pipe, inputs, target):
        pipe.add_action_observer(self.timer)
        try:
            start = time.perf_counter()
            loss = pipe.step(inputs, target=target)
            end = time.perf_counter()
        finally:
            pipe.remove_action_observer(self.timer)
        step = len(self.step_times) + 1
        busy = comm = 0.0
        for action, t0, t1, wait in self.timer.take():
            kind = action.kind.value
            if wait > 0:
                self.events.append((f"wait {action}", WAIT, t0, t0 + wait, step))
            if kind in KINDS:
                busy += t1 - t0 - wait
                total = self.kind_times.setdefault(f"{action.stage}{kind}", [0.0, 0])
                total[0] += t1 - t0 - wait
                total[1] += 1
            else:
                comm += t1 - t0
            self.events.append((str(action), category(kind), t0 + wait, t1, step))
        if self.first_totals is None:
            self.first_totals = StepTotals()
            self.first_totals.add(end - start, busy, comm)
        else:
            self._check_pace(step, end - start)
            self.steady_totals.add(end - start, busy, comm)
        self._trim_events(step)
        return loss

    def _check_pace(self, step: int, seconds: float) -> None:
        """Count a step much slower than the steady steps before it (a straggling peer, a
        swapping host, a recompilation), which the summary's means would hide; the run ends with
        one warning about them (:meth:`_slow_warning`). A step that was slow while the machine
        had more runnable work than processors (:func:`machine_busy`) is not counted: on a
        machine shared with other work, that is the other work's doing."""
        steady = self.steady_totals
        mean = steady.seconds / steady.steps if steady.steps else 0.0
        if steady.steps >= SLOW_AFTER_STEPS and seconds > SLOW_FACTOR * mean \
                and not machine_busy():
            self.slow_steps.append((step, seconds, seconds / mean))

    def _trim_events(self, step: int) -> None:
        if self.events and self.events[0][4] <= step - TRACE_STEPS:
            self.events = [e for e in self.events if e[4] > step - TRACE_STEPS]

    def record_step(self, step, loss, step_time, tokens, grad_norm, lr, started,
                    data: dict | None = None, extra: dict | None = None) -> None:
        """``data``: the batch's figures (:func:`pp_core.app.rank.data_metrics.batch_figures`);
        ``extra``: more figures for the metrics line (``aux_loss`` of MoE models)."""
        self.steps.append(step)
        self.step_times.append(step_time)
        self.tokens_per_s.append(tokens / step_time if step_time > 0 else 0.0)
        self.tokens_per_step = tokens
        if loss is not None:
            self.losses.append(loss)
        figures = {}
        if data:
            figures = {"valid_tokens_per_s": round(data["valid_tokens"] / step_time, 2)
                       if step_time > 0 else 0.0, "padding_fraction": data["padding_fraction"],
                       "docs": data["docs"]}
            self.data_figures.append(figures)
        saved = int(getattr(getattr(self.pipe, "saved_bytes", None), "peak", 0))
        self.saved_max = max(self.saved_max, saved)
        log_every = self.spec.train.log_every
        if step % log_every == 0 or step == self.spec.train.steps or len(self.steps) == 1:
            # every rank logs the same steps: the worst rank's peak, gathered only for them
            worst = max(gather_saved_peaks(saved, self.ctx.device))
            self._log(step, {"loss": loss, "tokens_per_s": round(self.tokens_per_s[-1], 2),
                             **figures, **(extra or {}), "peak_saved_bytes": worst,
                             "step_time_s": round(step_time, 6), "lr": lr,
                             "grad_norm": grad_norm,
                             "time": round(started + self.clock_offset, 3)})

    def record_eval(self, step: int, loss: float | None) -> None:
        self.eval_loss = loss
        if loss is None:
            return
        self.say(f"step {step}: eval loss {loss:.4f}")
        self._log(step, {"eval_loss": loss})

    def _log(self, step: int, values: dict) -> None:
        """One logged step on the first rank: a line of ``output.metrics`` and the plugins'
        ``pp_report_metrics``."""
        if self.rank != 0:
            return
        if self.metrics:
            self.metrics.write({"step": step, **values})
        self.plugins.report_metrics(step, values)

    # ------------------------------------------------------------------ end of run

    def _rank_figures(self, dp_units: int) -> dict[str, Any]:
        memory, kind = peak_memory(self.ctx.device)
        # the first step pays for warm-up: it counts only when it is the only one
        steady = self.steady_totals if self.steady_totals.steps else self.first_totals
        bubble = comm = None
        if steady is not None and steady.timed and steady.seconds > 0:
            bubble = max(0.0, 1.0 - steady.busy / steady.seconds)
            comm = steady.comm / steady.seconds
        return {
            "rank": self.rank, "pp_rank": self.ctx.meshes.pp_rank,
            "dp_rank": self.ctx.meshes.dp_rank,
            "stages": list(self.pipe.stage_indices), "bubble_measured": bubble,
            "comm_share": comm, "peak_saved_bytes": self.saved_max,
            "peak_memory": memory, "memory_kind": kind, "dp_units": dp_units,
            "pipeline_step_s": steady.seconds / steady.steps if steady and steady.steps else None,
            "kind_times": {k: seconds / count for k, (seconds, count) in self.kind_times.items()
                           if count},
            "events": [(n, c, s + self.clock_offset, e + self.clock_offset, st)
                       for n, c, s, e, st in self.events],
            "slow_steps": (len(self.slow_steps), max(self.slow_steps, key=lambda s: s[2],
                                                     default=None)),
        }

    def finish(self, start_step: int, wall_s: float, dp_units: int) -> dict[str, Any]:
        """Gather every rank's figures on rank 0, write trace/image/summary; rank 0 returns it."""
        if self.metrics:
            self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        mine = self._rank_figures(dp_units)
        gathered = [None] * self.ctx.world_size if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if self.rank != 0:
            return {"rank": self.rank, "dp_units": dp_units, "stages": mine["stages"]}
        summary = self._summarise(gathered, start_step, wall_s)
        summary["dp_units"] = dp_units
        return summary

    def _data_summary(self) -> dict[str, Any]:
        """Means over the run's steps of the batch figures (none for data without targets)."""
        figures = self.data_figures
        if not figures:
            return {}
        return {key: sum(f[key] for f in figures) / len(figures)
                for key in ("valid_tokens_per_s", "padding_fraction", "docs")}

    def _summarise(self, ranks: list[dict], start_step: int, wall_s: float) -> dict[str, Any]:
        spec, out = self.spec, self.spec.output
        schedule = self._schedule()
        result, note = simulate_measured(schedule, ranks)
        simulated = None if result is None else \
            [idle / (result.makespan or 1.0) for idle in result.idle]
        for figures in ranks:
            figures["bubble_simulated"] = None if simulated is None else \
                simulated[figures["pp_rank"]]
        if out.trace:
            write_output("output.trace", out.trace, lambda to: write_json(run_trace(ranks), to))
        if out.schedule_image and schedule is not None:
            write_output("output.schedule_image", out.schedule_image, lambda to: to.write_text(
                run_picture(schedule, ranks, start_step)))
        model = spec.model.name or spec.model.target
        summary = {
            "source": spec.source, "model": model, "data": spec.data.name,
            "num_params": self.num_params, "schedule": schedule.name if schedule else
            spec.pipeline.pp_schedule, "pp_size": spec.dims.pp, "dp_size": spec.dims.dp,
            "tp_size": spec.dims.tp, "mesh": describe_mesh(self.ctx.meshes.mesh),
            "num_stages": schedule.num_stages if schedule else None,
            "num_microbatches": spec.pipeline.num_microbatches,
            "first_step": start_step + 1, "last_step": self.steps[-1] if self.steps else start_step,
            "wall_s": wall_s, "tokens_per_step": self.tokens_per_step, "losses": self.losses,
            "steps": self.steps, "step_times": self.step_times, "tokens_per_s": self.tokens_per_s,
            "eval_loss": self.eval_loss, "bubble_note": note, **self._data_summary(),
            "ranks": [{k: v for k, v in r.items() if k not in ("events", "kind_times",
                                                              "slow_steps")}
                      for r in ranks],
            "holds": _holds(self.pipe),
            "peak_saved_bytes": [r["peak_saved_bytes"] for r in ranks] if self.steps else None,
            "outputs": {"metrics": out.metrics, "trace": out.trace,
                        "schedule image": out.schedule_image,
                        "checkpoints": spec.checkpoint.dir},
        }
        if self.attempts is not None:
            summary["restarts"] = self.attempts.summary(time.time())
        if self.checkpoints is not None:
            summary["saves"] = self.checkpoints.figures()
        planned = spec.prediction
        if planned is not None:  # pipeline.pp_schedule: auto - what the planner predicted
            measured = [r["pipeline_step_s"] for r in ranks if r["pipeline_step_s"] is not None]
            summary["plan"] = {**{k: v for k, v in planned.items() if k != "layouts"},
                               "measured_step_s": max(measured) if measured else None}
        if out.summary and self.steps:
            print(format_summary(summary), flush=True)
        _slow_warning(ranks, start_step)
        return summary

    def _schedule(self):
        """The schedule this run ran: the one :func:`~pp_core.planning.plan.plan_pipeline`
        planned for the pipeline (no second planning that could disagree with it)."""
        return getattr(self.pipe, "schedule", None)


def machine_busy() -> bool:
    """Whether this machine has more runnable work than processors (its 1-minute load average
    over the cores this process may use): then a slow step is other work's doing, not news."""
    try:
        return os.getloadavg()[0] > cpu_cores()
    except OSError:  # no load average on this platform: count every slow step
        return False


def _slow_warning(ranks: list[dict], start_step: int) -> None:
    """One warning for the run's slow steps, every rank's counted together, naming the slowest."""
    counts = [(figures["rank"], *figures["slow_steps"]) for figures in ranks
              if figures["slow_steps"][0]]
    if not counts:
        return
    rank, _count, (step, seconds, factor) = max(counts, key=lambda c: c[2][2])
    logger.warning("%d step(s) took over %gx the mean of the steps before them (on rank(s) %s); "
                   "the slowest, step %d on rank %d, took %.3f s, %.1fx: a straggling peer, a "
                   "swapping host or a recompilation (output.trace shows the last steps)",
                   sum(c[1] for c in counts), SLOW_FACTOR, ", ".join(str(c[0]) for c in counts),
                   start_step + step, rank, seconds, factor)


def _holds(pipe) -> list | None:
    """Per stage, the module names it holds (the split every rank built), or ``None``."""
    split = getattr(getattr(pipe, "plan", None), "split", None)
    return None if split is None else [list(fqns) for fqns in split.fqns_per_stage]
