"""What a person watching a run sees: a progress line on the first rank, then a summary table.

On a terminal :class:`Progress` redraws one line (``\\r``) with a bar, the step, the loss,
tokens/s, the step time and the ETA; when stdout is not a terminal (CI logs, a file) it prints a
plain line every ``log_every`` steps instead, so logs stay readable. :func:`format_summary` renders
the end-of-run table (loss first -> last, throughput, bubble per rank measured and simulated,
peak memory per rank).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import IO, Any, Sequence

__all__ = ["Progress", "phase", "format_duration", "format_bytes", "format_summary"]


def phase(text: str, stream: IO[str] | None = None) -> None:
    """Say that a phase of a long command begins (``pp-core: building ...``), where the progress
    line goes (stdout, as ``starting N rank(s)``; stderr holds the errors), so that no stretch
    of seconds passes in silence."""
    print(f"pp-core: {text}", file=stream if stream is not None else sys.stdout, flush=True)


def format_duration(seconds: float | None) -> str:
    """``75.0 -> '1m15s'``; ``None -> '?'``."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_bytes(count: float | None) -> str:
    if count is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


class Progress:
    """The first rank's progress display. ``mode``: ``auto``, ``bar``, ``plain`` or ``off``."""

    def __init__(self, total_steps: int, start_step: int = 0, mode: str = "auto",
                 log_every: int = 10, stream: IO[str] | None = None, width: int = 24):
        self.stream = stream if stream is not None else sys.stdout
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "plain"
        self.mode = mode
        self.total, self.start, self.log_every, self.width = total_steps, start_step, log_every, width
        self.started = time.perf_counter()
        self._drawn = False
        self.suffix = ""  # what the run adds to every line (a restart's account)

    def eta(self, step: int) -> float | None:
        done = step - self.start
        if done <= 0:
            return None
        return (time.perf_counter() - self.started) / done * (self.total - step)

    def line(self, step: int, loss: float | None, tokens_per_s: float, step_time: float) -> str:
        loss_text = "   n/a" if loss is None else f"{loss:7.4f}"
        return (f"step {step:>{len(str(self.total))}}/{self.total}  loss {loss_text}  "
                f"{tokens_per_s:,.0f} tok/s  {step_time * 1000:,.0f} ms/step  "
                f"ETA {format_duration(self.eta(step))}{self.suffix}")

    def update(self, step: int, loss: float | None, tokens_per_s: float, step_time: float) -> None:
        if self.mode == "off":
            return
        text = self.line(step, loss, tokens_per_s, step_time)
        if self.mode == "bar":
            filled = int(self.width * step / max(self.total, 1))
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r[{bar}] {text}\x1b[K")
            self._drawn = True
        elif step % self.log_every == 0 or step == self.total or step == self.start + 1:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line that must not be overwritten by the bar (evaluation, checkpoints)."""
        if self.mode == "off":
            return
        if self._drawn:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.mode == "bar" and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    out.extend("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    return out


def compact_names(fqns: Sequence[str]) -> str:
    """Module names with runs of numbered siblings folded: ``layers.0-3`` for ``layers.0`` ..
    ``layers.3``."""
    out: list[list] = []  # [prefix, first, last] or [name]
    for name in fqns:
        prefix, _, index = name.rpartition(".")
        if index.isdecimal() and out and len(out[-1]) == 3 and out[-1][0] == prefix \
                and out[-1][2] + 1 == int(index):
            out[-1][2] = int(index)
        elif index.isdecimal():
            out.append([prefix, int(index), int(index)])
        else:
            out.append([name])
    return ", ".join(item[0] if len(item) == 1 else f"{item[0]}.{item[1]}" if item[1] == item[2]
                     else f"{item[0]}.{item[1]}-{item[2]}" for item in out)


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run table; ``summary`` is what :func:`pp_core.app.rank.train` returns on rank 0."""
    losses = summary.get("losses") or []
    times = summary.get("step_times") or []
    tps = summary.get("tokens_per_s") or []
    lines = [f"pp-core run summary: {summary.get('source', '')}".rstrip()]
    lines.append(
        f"  {summary['model']} ({summary['num_params'] / 1e6:.2f}M params) on {summary['data']}; "
        f"schedule {summary['schedule']}, pp {summary['pp_size']} x dp {summary['dp_size']}"
        f"{' x tp ' + str(summary['tp_size']) if summary.get('tp_size', 1) > 1 else ''}, "
        f"{summary['num_stages']} stages, {summary['num_microbatches']} microbatches/step")
    if summary.get("mesh"):
        lines.append(f"  mesh {summary['mesh']}")
    first_step, last_step = summary["first_step"], summary["last_step"]
    lines.append(f"  steps {first_step}..{last_step} in {format_duration(summary['wall_s'])} "
                 f"({summary['tokens_per_step']:,} tokens/step)")
    if losses:
        tail = losses[-min(10, len(losses)):]
        lines.append(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f} (first -> last step; mean of "
                     f"last {len(tail)}: {statistics.fmean(tail):.4f})")
    if summary.get("eval_loss") is not None:
        lines.append(f"  eval loss {summary['eval_loss']:.4f}")
    if times:
        steady = times[1:] if len(times) > 1 else times
        lines.append(f"  throughput {statistics.median(tps[1:] if len(tps) > 1 else tps):,.0f} "
                     f"tokens/s (median), step time {statistics.median(steady) * 1000:,.0f} ms "
                     f"(median, first step {times[0] * 1000:,.0f} ms)")
    if summary.get("valid_tokens_per_s") is not None:  # a dataset with integer targets
        lines.append(f"  valid tokens {summary['valid_tokens_per_s']:,.0f}/s (mean), padding "
                     f"{summary['padding_fraction']:.1%}, {summary['docs']:,.1f} documents/step")
    if summary.get("peak_saved_bytes"):  # measured: what autograd held saved, per rank
        lines.append("  peak saved for backward per rank: " + ", ".join(
            f"{b / 2**20:,.2f} MiB" for b in summary["peak_saved_bytes"]))
    planned = summary.get("plan")
    if planned:
        measured = planned.get("measured_step_s")
        modes = planned.get("activation_checkpointing") or []
        ac = "" if all(m == "none" for m in modes) else \
            f", activation checkpointing per stage {' '.join(modes)}"
        layout = f"{planned['layout']}, " if planned.get("layout") else ""  # layout: auto
        lines.append(f"  auto plan: {layout}{planned['schedule']}, "
                     f"{planned['stages_per_rank']} stage(s)/rank, microbatches of "
                     f"{planned['microbatch_size']}{ac}; pipeline step predicted "
                     f"{planned['predicted_step_s'] * 1000:,.1f} ms, measured "
                     + ("-" if measured is None else f"{measured * 1000:,.1f} ms (mean of the "
                        f"steps after the first, slowest rank)"))
    rows = []
    for rank in summary.get("ranks", []):
        rows.append([str(rank["rank"]), ",".join(map(str, rank["stages"])),
                     _percent(rank.get("bubble_measured")), _percent(rank.get("comm_share")),
                     _percent(rank.get("bubble_simulated")),
                     format_bytes(rank.get("peak_memory"))
                     + (f" ({rank['memory_kind']})" if rank.get("memory_kind") else "")])
    if rows:
        lines.append("")
        lines.extend("  " + row for row in _table(
            ["rank", "stages", "bubble (measured)", "of it in send/recv", "bubble (simulated)",
             "peak memory"],
            rows))
        note = summary.get("bubble_note")
        if note:
            lines.append(f"  {note}")
    for stage, fqns in enumerate(summary.get("holds") or []):
        lines.append(f"  stage {stage} holds {compact_names(fqns)}")
    saves = summary.get("saves")
    if saves:
        how = "staged to host memory, written in the background" if saves["async"] else \
            "written in the step"
        lines.append(f"  checkpoints: {saves['saves']} saved ({how}); a save held the step "
                     f"{saves['blocked_mean_s'] * 1000:,.0f} ms (mean; longest "
                     f"{saves['blocked_max_s'] * 1000:,.0f} ms"
                     + (f", {saves['waited_s']:.2f} s of it waiting for the previous save)"
                        if saves["waited_s"] >= 0.01 else ")")
                     + (f"; the run's end waited {saves['end_waited_s']:.2f} s for the last"
                        if saves.get("end_waited_s", 0) >= 0.01 else ""))
    lines.extend(_restart_lines(summary.get("restarts")))
    outputs = summary.get("outputs") or {}
    if outputs:
        lines.append("")
        lines.extend(f"  {name}: {path}" for name, path in outputs.items() if path)
    return "\n".join(lines)


def _restart_lines(restarts: dict | None) -> list[str]:
    """The summary's account of restarts (:meth:`pp_core.app.restarts.Attempts.summary`)."""
    if not restarts:
        return []
    lines = ["", f"  restarts {restarts['restarts']}: {restarts['steps_redone']} step(s) redone; "
                 f"goodput {restarts['goodput']:.1%} of {format_duration(restarts['wall_s'])} "
                 f"(wall time on steps that were kept)"]
    for found in restarts["recoveries"]:
        lines.append(f"  restart {found['restart']}: failed after step "
                     f"{found['failed_after_step']}, resumed at {found['resumed_from']}; "
                     f"{found['recovery_s']:.1f} s from the last step before it to the next "
                     f"(down {found['down_s']:.1f} s, start and load {found['startup_s']:.1f} s, "
                     f"first step {found['first_step_s']:.1f} s)")
    return lines
