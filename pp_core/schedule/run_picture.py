"""The picture of a run: one step as it was measured, above the same step as simulated.

``pp-core run``'s ``output.schedule_image``. The top half draws what the ranks did in one steady
step - per pipeline rank, each action at its real start and length, the time an action spent
waiting for a peer's message as a wait, sends and receives apart from compute, the rest (the
executor's own time, the step's edges) idle. The bottom half draws the schedule the simulator
plays with that step's own action times (:func:`step_costs`): the step as it would run with
nothing but the schedule's dependencies holding a rank up, so the difference between the halves
is what the run lost to waiting, messages and overhead - and not to a load that changed over the
run. Both share one time axis in milliseconds from the step's first action, and each row carries
its bubble in that step: the share of the step it spent outside F/B/I/W, measured above and
simulated below. Plain SVG from the standard library; the run supplies the events
(:mod:`pp_core.app.rank.run_outputs`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from html import escape
from typing import Sequence

from pp_core.schedule.labels import WAIT, kind_of_label, short_name
from pp_core.schedule.render import COLOURS
from pp_core.schedule.simulate import SimResult

__all__ = ["MeasuredRank", "steady_step", "step_costs", "render_run_svg"]

COMM_COLOUR, WAIT_COLOUR = "#9aa0a6", "#e06666"
LABEL_W, SHARE_W, ROW_H, GAP = 64, 150, 22, 4


@dataclass(frozen=True)
class MeasuredRank:
    """One pipeline rank's actions in the drawn step: ``(label, category, start_s, end_s)``
    (``"1F3"``, ``"forward"``; a wait is ``("wait 1F3", "wait", ...)``)."""

    rank: int
    events: Sequence[tuple[str, str, float, float]]

    def busy(self) -> float:
        """Seconds spent in F/B/I/W (a wait is not: it is recorded apart)."""
        return sum(t1 - t0 for label, category, t0, t1 in self.events
                   if category != WAIT and kind_of_label(label) in COLOURS)


def step_costs(measured: Sequence[MeasuredRank]) -> dict[int, dict[str, float]]:
    """``{stage: {kind: mean seconds}}`` of the step's compute actions, for
    :class:`~pp_core.schedule.simulate.Costs` ``per_stage``."""
    times: dict[tuple[int, str], list[float]] = {}
    for rank in measured:
        for label, category, t0, t1 in rank.events:
            kind, digits = kind_of_label(label), label[:len(label) - len(label.lstrip("0123456789"))]
            if category != WAIT and kind in COLOURS and digits:
                times.setdefault((int(digits), kind), []).append(t1 - t0)
    costs: dict[int, dict[str, float]] = {}
    for (stage, kind), values in times.items():
        costs.setdefault(stage, {})[kind] = sum(values) / len(values)
    return costs


def steady_step(events_per_rank: Sequence[Sequence[tuple]]) -> int | None:
    """The step to draw: of the steps every rank recorded (``(label, category, start, end,
    step)``), leaving out the first one when there are others (it pays for warm-up), the one
    whose length is the median's - a typical step, not the fastest or a straggler."""
    steps = set.intersection(*({e[4] for e in events} for events in events_per_rank)) \
        if events_per_rank else set()
    if len(steps) > 1:
        steps.discard(min(steps))
    if not steps:
        return None
    length = {s: max(e[3] for r in events_per_rank for e in r if e[4] == s)
              - min(e[2] for r in events_per_rank for e in r if e[4] == s) for s in steps}
    middle = statistics.median_low(length.values())
    return min(s for s in steps if length[s] == middle)


def render_run_svg(measured: Sequence[MeasuredRank], simulated: SimResult, step: int,
                   max_width: int = 1600) -> str:
    """The measured step (``measured``, one entry per pipeline rank) above ``simulated`` (times
    in seconds; best with :func:`step_costs` of the same step), on one axis."""
    origin = min((e[2] for r in measured for e in r.events), default=0.0)
    measured_span = max((e[3] for r in measured for e in r.events), default=origin) - origin
    span = max(measured_span, simulated.makespan, 1e-9)
    scale = (max_width - LABEL_W - SHARE_W - 20) / span
    plot_w = span * scale
    width = math.ceil(LABEL_W + plot_w + SHARE_W + 10)
    sim_rows = simulated.timeline
    top = 44
    sim_top = top + len(measured) * (ROW_H + GAP) + 26
    axis_y = sim_top + len(sim_rows) * (ROW_H + GAP) + 4
    height = axis_y + 100
    name = simulated.schedule.name
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">',
           _DEFS, f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{LABEL_W}" y="18" font-size="13" font-weight="bold">{_text(name)}: '
           f'step {step} as this run measured it, above the same step simulated with its '
           f'action times</text>',
           _heading(top - 8, f"measured, step {step} ({measured_span * 1e3:,.1f} ms)")]
    for index, rank in enumerate(measured):
        y = top + index * (ROW_H + GAP)
        out += _row(y, f"rank {rank.rank}", scale,
                    [(label, category, t0 - origin, t1 - origin)
                     for label, category, t0, t1 in rank.events], plot_w)
        bubble = 1 - rank.busy() / measured_span if measured_span > 0 else None
        out.append(_share(y, plot_w, bubble, "measured"))
    out.append(_heading(sim_top - 8, f"simulated ({simulated.makespan * 1e3:,.1f} ms)"))
    for index, row in enumerate(sim_rows):
        y = sim_top + index * (ROW_H + GAP)
        events = [(str(action), action.kind.value, t0, t1) for action, t0, t1 in row]
        out += _row(y, f"rank {index}", scale, events, plot_w)
        idle = simulated.idle[index] / simulated.makespan if simulated.makespan else None
        out.append(_share(y, plot_w, idle, "simulated"))
    out += _axis(axis_y, span, scale)
    out += _legend(axis_y + 42)
    out.append(f'<text x="4" y="{axis_y + 80}">bubble: the share of this step a rank spent '
               f'outside F/B/I/W (the run summary\'s are the means over the steady steps); '
               f'wait: an action waiting for a peer\'s message</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _text(value: str) -> str:
    return escape(value, quote=False)


_DEFS = ('<defs><pattern id="idle" width="6" height="6" patternUnits="userSpaceOnUse" '
         'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/>'
         '<line x1="0" y1="0" x2="0" y2="6" stroke="#d0d0d0" stroke-width="2"/></pattern>'
         '<pattern id="wait" width="5" height="5" patternUnits="userSpaceOnUse" '
         'patternTransform="rotate(-45)"><rect width="5" height="5" fill="#fbe3e3"/>'
         f'<line x1="0" y1="0" x2="0" y2="5" stroke="{WAIT_COLOUR}" stroke-width="1.5"/>'
         '</pattern></defs>')


def _heading(y: float, text: str) -> str:
    return f'<text x="{LABEL_W}" y="{y:.1f}" font-weight="bold">{_text(text)}</text>'


def _fill(label: str, category: str) -> str:
    if category == WAIT:
        return "url(#wait)"
    return COLOURS.get(kind_of_label(label), COMM_COLOUR)


def _row(y: float, title: str, scale: float, events, plot_w: float) -> list[str]:
    out = [f'<text x="4" y="{y + ROW_H / 2 + 4:.1f}">{title}</text>',
           f'<rect x="{LABEL_W}" y="{y}" width="{plot_w:.2f}" height="{ROW_H}" fill="url(#idle)">'
           f'<title>idle</title></rect>']
    for label, category, t0, t1 in events:
        if t1 <= t0:
            continue
        x, w = LABEL_W + t0 * scale, (t1 - t0) * scale
        comm = kind_of_label(label) not in COLOURS and category != WAIT
        top, height = (y + ROW_H / 3, ROW_H / 3) if comm else (y, ROW_H)
        out.append(f'<rect x="{x:.2f}" y="{top:.1f}" width="{w:.2f}" height="{height:.1f}" '
                   f'fill="{_fill(label, category)}" stroke="white" stroke-width="0.4">'
                   f'<title>{_text(label)} {t0 * 1e3:.2f}-{t1 * 1e3:.2f} ms</title></rect>')
        if not comm and category != WAIT and w >= len(label) * 7 + 4:  # 11px monospace
            out.append(f'<text x="{x + w / 2:.2f}" y="{y + ROW_H / 2 + 4:.1f}" '
                       f'text-anchor="middle">{_text(label)}</text>')
    return out


def _share(y: float, plot_w: float, bubble: float | None, how: str) -> str:
    shown = "n/a" if bubble is None else f"{100 * bubble:.1f}%"
    return (f'<text x="{LABEL_W + plot_w + 8:.1f}" y="{y + ROW_H / 2 + 4:.1f}">bubble {shown} '
            f'{how}</text>')


def _axis(y: float, span: float, scale: float) -> list[str]:
    """Ticks every 1, 2 or 5 x 10^k ms, about ten of them."""
    raw = span * 1e3 / 10
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)),
               key=lambda s: abs(s - raw))
    out = [f'<line x1="{LABEL_W}" y1="{y}" x2="{LABEL_W + span * scale:.2f}" y2="{y}" '
           f'stroke="#444"/>']
    tick = 0.0
    while tick <= span * 1e3 + 1e-9:
        x = LABEL_W + tick / 1e3 * scale
        out.append(f'<line x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + 4}" stroke="#444"/>')
        out.append(f'<text x="{x:.2f}" y="{y + 15}" text-anchor="middle">{tick:g}</text>')
        tick += step
    out.append(f'<text x="{LABEL_W + span * scale:.2f}" y="{y + 28}" text-anchor="end">time '
               f'(ms) →</text>')
    return out


def _legend(y: float) -> list[str]:
    out, x = [], LABEL_W
    items = [(colour, f"{kind} {short_name(kind)}") for kind, colour in COLOURS.items()]
    items += [(COMM_COLOUR, "send/recv"), ("url(#wait)", "wait"), ("url(#idle)", "idle")]
    for fill, text in items:
        out.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{fill}" '
                   f'stroke="#ccc"/><text x="{x + 16}" y="{y}">{_text(text)}</text>')
        x += 24 + 7 * len(text)
    return out
