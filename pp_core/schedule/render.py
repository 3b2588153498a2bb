"""Pictures of a simulated schedule: a text timeline for the terminal and an SVG image.

The text form: one row per rank, one column per time slot, ``.`` for an
idle slot and ``~`` for the later slots of a multi-slot action (a ``B`` at unit costs)::

    rank0: 0F0 0F1 .   .   0B0 ~   0B1 ~
    rank1: .   1F0 1B0 ~   1F1 1B1 ~

The SVG draws the same rows to scale (F/B/I/W in distinct colours, idle time hatched) with a
caption carrying the figures. Both are plain strings built with the standard library only.
"""

from __future__ import annotations

import functools
import html
import math

from pp_core.errors import ScheduleError
from pp_core.schedule.labels import short_name
from pp_core.schedule.simulate import SimResult

__all__ = ["render_text", "render_svg", "caption", "COLOURS", "MAX_TEXT_SLOTS"]

# escapes &, < and > as xml.sax.saxutils.escape does, without the 25 ms its urllib imports cost
_escape = functools.partial(html.escape, quote=False)

MAX_TEXT_SLOTS = 2_000_000
"""The most time slots (over all ranks) a text timeline draws: beyond it no terminal shows it and
the text alone grows quadratically (pp ranks x a makespan of about 3 pp slots for 1F1B)."""

COLOURS = {"F": "#4c8bf5", "B": "#f08c3c", "I": "#e8c23a", "W": "#57b86a"}
_QUANTA = (1.0, 0.5, 0.25, 0.2, 0.1, 0.05, 0.01)


def _quantum(result: SimResult) -> tuple[float, bool]:
    """The slot length: the largest of _QUANTA dividing every start/end; ``exact`` is False when
    none does and times are rounded to the shortest action's half."""
    times = [t for row in result.timeline for _, t0, t1 in row for t in (t0, t1)]
    for q in _QUANTA:
        if all(abs(t / q - round(t / q)) < 1e-6 for t in times):
            return q, True
    shortest = min((t1 - t0 for row in result.timeline for _, t0, t1 in row if t1 > t0),
                   default=1.0)
    return shortest / 2, False


def _labeller(schedule):
    """How an action is written: ``"2F0"``, or ``"2F0.1"`` (microbatch 0, slice 1) when the
    schedule cuts microbatches into slices."""
    if schedule.seq_chunks == 1:
        return str
    return lambda a: f"{a.stage}{a.kind.value}{schedule.unit_label(a.microbatch)}"


def render_text(result: SimResult) -> str:
    """The reference-style timeline, one line per rank (slots of ``quantum`` time units)."""
    q, _exact = _quantum(result)
    slots = [round(row[-1][2] / q) if row else 0 for row in result.timeline]
    if sum(slots) > MAX_TEXT_SLOTS:
        s = result.schedule
        raise ScheduleError(
            f"the text timeline of {s.name} at pp={s.num_ranks}, microbatches="
            f"{s.num_microbatches} would be {len(slots)} rows of up to {max(slots):,} slots "
            f"({sum(slots):,} in all; pp-core draws at most {MAX_TEXT_SLOTS:,}); use 'pp-core "
            f"schedule simulate' for the figures, or its --trace FILE for a zoomable timeline")
    label = _labeller(result.schedule)
    labels = [label(a) for row in result.timeline for a, _, _ in row]
    width = max(3, max(map(len, labels), default=3)) + 1
    num_ranks = len(result.timeline)
    head = len(f"rank{num_ranks - 1}:") + 1
    lines = []
    for rank, row in enumerate(result.timeline):
        cells: list[str] = []
        for action, t0, t1 in row:
            first, last = round(t0 / q), round(t1 / q)
            if last <= first:
                continue  # zero-length action: nothing to draw
            cells.extend(["."] * (first - len(cells)))
            cells.append(label(action))
            cells.extend(["~"] * (last - first - 1))
        text = "".join(c.ljust(width) for c in cells)
        lines.append((f"rank{rank}:".ljust(head) + text).rstrip())
    return "\n".join(lines)


def caption(result: SimResult) -> str:
    """One line of figures: makespan, bubble ratio, span bubble, peak activations per rank."""
    s = result.schedule
    d = result.to_dict()
    stages = f", {s.num_stages} stages" if s.num_stages != s.num_ranks else ""
    costs = result.costs
    unit = f"F={costs.F:g} B={costs.B:g} I={costs.I:g} W={costs.W:g}"
    if costs.per_stage:
        unit += " (+per-stage)"
    if result.comm_latency:
        unit += f" latency={result.comm_latency:g}"
    if result.processors is not None:
        unit += f" on {result.processors:g} shared processors"
    peaks = " ".join(map(str, d["peak_activations"]))
    slices = f", seq_chunks={s.seq_chunks} (units are microbatch.slice)" if s.seq_chunks > 1 \
        else ""
    return (f"{s.name}: pp={s.num_ranks}{stages}, microbatches={s.num_sequences}{slices} [{unit}] — "
            f"makespan {d['makespan']}, bubble {d['bubble']} (ratio {result.bubble_ratio:.3f}), "
            f"span bubble {d['span_bubble']}, peak activations per rank {peaks}")


def render_svg(result: SimResult, max_width: int = 1600) -> str:
    """An SVG picture: one row per rank, actions to scale, idle time hatched, figures below."""
    makespan = result.makespan or 1.0
    label_w, row_h, gap, top = 70, 26, 6, 30
    label = _labeller(result.schedule)
    scale = max(0.5, min(40.0, (max_width - label_w - 20) / makespan))
    plot_w = makespan * scale
    num_ranks = len(result.timeline)
    height = top + num_ranks * (row_h + gap) + 70
    width = math.ceil(label_w + plot_w + 20)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">',
        "<defs><pattern id=\"idle\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
        "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#f4f4f4\"/>"
        "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#d0d0d0\" stroke-width=\"2\"/>"
        "</pattern></defs>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{label_w}" y="18" font-size="13" font-weight="bold">'
        f"{_escape(result.schedule.name)} — time →</text>",
    ]
    font = min(11.0, scale * 0.9)
    for rank, row in enumerate(result.timeline):
        y = top + rank * (row_h + gap)
        out.append(f'<text x="4" y="{y + row_h / 2 + 4:.1f}">rank {rank}</text>')
        out.append(f'<rect x="{label_w}" y="{y}" width="{plot_w:.2f}" height="{row_h}" '
                   f'fill="url(#idle)"><title>idle</title></rect>')
        for action, t0, t1 in row:
            if t1 <= t0:
                continue
            kind = action.kind.value
            x, w = label_w + t0 * scale, (t1 - t0) * scale
            out.append(
                f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h}" '
                f'fill="{COLOURS[kind]}" stroke="white" stroke-width="0.5">'
                f"<title>{label(action)} ({short_name(kind)}) {t0:g}–{t1:g}</title></rect>")
            text = label(action)
            if w >= len(text) * font * 0.62 and font >= 5:
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + row_h / 2 + font / 3:.1f}" '
                           f'font-size="{font:.1f}" text-anchor="middle">{text}</text>')
    y = top + num_ranks * (row_h + gap) + 14
    x = label_w
    for kind, colour in COLOURS.items():
        out.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 16}" y="{y}">{kind} {short_name(kind)}</text>')
        x += 130
    out.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="url(#idle)" '
               f'stroke="#ccc"/><text x="{x + 16}" y="{y}">idle</text>')
    d = result.to_dict()
    out.append(f'<text x="4" y="{y + 22}">{_escape(caption(result))}</text>')
    out.append(f'<text x="4" y="{y + 40}">busy per rank: '
               f'{_escape(" ".join(str(b) for b in d["busy"]))}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
