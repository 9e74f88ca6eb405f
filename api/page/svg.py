"""Inline SVG plots drawn on the server: a job's step time with the incident's moments marked,
and a rank × step heatmap.

Our own small drawing code rather than a chart library: the page must open offline and
without script, and both plots are polylines and a grid of rectangles. Every text that
reaches the SVG goes through `html.escape`; a plot with nothing to draw says so in place
instead of drawing empty axes. The `<svg>` carries no xmlns: inline SVG in HTML needs none,
and the page then names no URL outside the app.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

STEP_COLOUR = "#1f77b4"
BASELINE_COLOUR = "#8c8c8c"
ONSET_COLOUR = "#d62728"
RESOLVED_COLOUR = "#2ca02c"
HEAT_LOW = (254, 230, 206)  # the lowest value shown: light, yet not the page's white
HEAT_HIGH = (166, 54, 3)
NO_DATA = "#e4e4e4"
TEXT = 'font-family="sans-serif" font-size="12"'  # grey unless given a fill (the root's)
LABEL_PX = 12  # a row or column label needs about this much room


@dataclass(frozen=True, slots=True)
class StepSample:
    """One point of the step-time chart; None where the store holds no finite value."""

    step: int
    time_s: float | None
    baseline_s: float | None


@dataclass(frozen=True, slots=True)
class Markers:
    """The incident's moments on the step axis."""

    onset: int
    opened: int
    resolved: int | None


@dataclass(frozen=True, slots=True)
class Heatmap:
    """Rows are ranks, columns step ranges [first, last]; values[row][col] is None where no
    figure is stored for that rank and range."""

    metric: str
    ranks: Sequence[int]
    columns: Sequence[tuple[int, int]]
    values: Sequence[Sequence[float | None]]


@dataclass(frozen=True, slots=True)
class _Scale:
    """A linear map from the domain [lo, hi] to the pixel range [a, b]."""

    lo: float
    hi: float
    a: float
    b: float

    def __call__(self, v: float) -> float:
        if self.hi == self.lo:
            return (self.a + self.b) / 2
        return self.a + (v - self.lo) / (self.hi - self.lo) * (self.b - self.a)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round values within [lo, hi], 1, 2 or 5 times a power of ten apart, so an
    axis reads at a glance."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
        return []
    if hi == lo:
        return [lo]
    raw = (hi - lo) / max(n, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def fmt(v: float) -> str:
    """A number as a person reads it on an axis or a tooltip: three significant digits."""
    return f"{v:.3g}"


def heat_colour(t: float) -> str:
    """The heatmap colour of t in [0, 1] (clamped): light at 0, dark at 1."""
    t = min(max(t, 0.0), 1.0)
    r, g, b = (round(lo + (hi - lo) * t) for lo, hi in zip(HEAT_LOW, HEAT_HIGH, strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def _svg(width: float, height: float, label: str, body: list[str]) -> str:
    return (f'<svg viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
            f'height="{height:.0f}" fill="#333" role="img" aria-label="{escape(label)}">'
            + "".join(body) + "</svg>")


def empty_plot(width: int, message: str) -> str:
    """A plot-sized notice instead of a plot with nothing to draw."""
    return _svg(width, 60, message, [
        f'<rect x="0" y="0" width="{width}" height="60" fill="#fafafa" stroke="#ccc"/>',
        f'<text x="{width / 2:.0f}" y="34" text-anchor="middle" {TEXT}>{escape(message)}</text>',
    ])


def _segments(points: Sequence[tuple[int, float | None]]) -> list[list[tuple[int, float]]]:
    """Runs of consecutive points with a value: a missing value breaks the line."""
    runs: list[list[tuple[int, float]]] = [[]]
    for step, v in points:
        if v is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((step, v))
    return [r for r in runs if r]


def _line(run: list[tuple[int, float]], x: _Scale, y: _Scale, colour: str, dash: str) -> str:
    if len(run) == 1:
        (s, v), = run
        return f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3" fill="{colour}"/>'
    pts = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in run)
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"'
            f'{extra}/>')


def _marker(xpos: float, top: float, bottom: float, colour: str, dash: str, label: str) -> str:
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<line x1="{xpos:.1f}" y1="{top}" x2="{xpos:.1f}" y2="{bottom}" stroke="{colour}"'
            f' stroke-width="2"{extra}/><text x="{xpos + 4:.1f}" y="{top + 12}" {TEXT} '
            f'fill="{colour}">{escape(label)}</text>')


def step_chart(samples: Sequence[StepSample], marks: Markers, *, width: int = 1000,
               height: int = 300) -> str:
    """The job's step time (solid) and its baseline (dashed) over the steps of `samples`, with
    a line at the onset (solid red), the opening (dashed red) and the resolution (green)."""
    times = [(s.step, s.time_s) for s in samples]
    baseline = [(s.step, s.baseline_s) for s in samples]
    values = [v for _, v in times + baseline if v is not None]
    if not any(v is not None for _, v in times):
        return empty_plot(width, "no step times stored for this incident's steps")
    left, right, top, bottom = 64, 16, 24, 40
    moments = [marks.onset, marks.opened] + ([marks.resolved] if marks.resolved is not None
                                             else [])
    steps = [s.step for s in samples] + moments
    x = _Scale(min(steps), max(steps), left, width - right)
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.1 or abs(hi) * 0.1 or 1.0
    lo = max(0.0, lo - pad) if lo >= 0 else lo - pad
    y = _Scale(lo, hi + pad, height - bottom, top)
    body = [f'<rect x="{left}" y="{top}" width="{width - left - right}" '
            f'height="{height - top - bottom}" fill="#fff" stroke="#ccc"/>']
    for t in nice_ticks(lo, hi + pad):
        body.append(f'<line x1="{left}" y1="{y(t):.1f}" x2="{width - right}" y2="{y(t):.1f}" '
                    f'stroke="#eee"/><text x="{left - 6}" y="{y(t) + 4:.1f}" '
                    f'text-anchor="end" {TEXT}>{fmt(t)} s</text>')
    for t in sorted({round(t) for t in nice_ticks(x.lo, x.hi, 8)}):
        body.append(f'<text x="{x(t):.1f}" y="{height - bottom + 16}" text-anchor="middle" '
                    f'{TEXT}>{t}</text>')
    body.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height - 6}" '
                f'text-anchor="middle" {TEXT}>step</text>')
    body += [_line(r, x, y, BASELINE_COLOUR, "6 4") for r in _segments(baseline)]
    body += [_line(r, x, y, STEP_COLOUR, "") for r in _segments(times)]
    body.append(_marker(x(marks.onset), top, height - bottom, ONSET_COLOUR, "",
                        f"onset {marks.onset}"))
    if marks.opened != marks.onset:
        body.append(_marker(x(marks.opened), top + 14, height - bottom, ONSET_COLOUR, "4 3",
                            f"opened {marks.opened}"))
    if marks.resolved is not None:
        body.append(_marker(x(marks.resolved), top + 28, height - bottom, RESOLVED_COLOUR,
                            "4 3", f"resolved {marks.resolved}"))
    body.append(f'<rect x="{left + 8}" y="{top - 18}" width="14" height="3" '
                f'fill="{STEP_COLOUR}"/><text x="{left + 26}" y="{top - 12}" {TEXT}>step time'
                f'</text><rect x="{left + 100}" y="{top - 18}" width="14" height="3" '
                f'fill="{BASELINE_COLOUR}"/><text x="{left + 118}" y="{top - 12}" {TEXT}>'
                'baseline</text>')
    return _svg(width, height, "step time with the incident's onset marked", body)


def heatmap_chart(h: Heatmap, marks: Markers, *, width: int = 1000) -> str:
    """One row per rank, one column per step range, coloured from the lowest value shown
    (light) to the highest (dark); grey where nothing is stored; the onset marked."""
    finite = [v for row in h.values for v in row if v is not None]
    if not h.ranks or not h.columns or not finite:
        return empty_plot(width, "no per-rank figures stored for these steps")
    left, right, top, bottom = 64, 16, 20, 72
    n_rows, n_cols = len(h.ranks), len(h.columns)
    cell_h = max(3, min(18, 400 // n_rows))
    cell_w = (width - left - right) / n_cols
    grid_bottom = top + cell_h * n_rows
    height = grid_bottom + bottom
    lo, hi = min(finite), max(finite)
    body: list[str] = []
    for r, rank in enumerate(h.ranks):
        ypos = top + r * cell_h
        for c, (first, last) in enumerate(h.columns):
            v = h.values[r][c]
            fill = NO_DATA if v is None else heat_colour((v - lo) / (hi - lo) if hi > lo else 0)
            shown = "nothing stored" if v is None else f"{escape(h.metric)} {fmt(v)}"
            body.append(f'<rect x="{left + c * cell_w:.1f}" y="{ypos}" width="{cell_w:.1f}" '
                        f'height="{cell_h}" fill="{fill}"><title>rank {rank}, steps {first}'
                        f'–{last}: {shown}</title></rect>')
    row_every = math.ceil(LABEL_PX / cell_h)
    for r in range(0, n_rows, row_every):
        body.append(f'<text x="{left - 6}" y="{top + r * cell_h + min(cell_h, LABEL_PX) - 2}" '
                    f'text-anchor="end" {TEXT}>{h.ranks[r]}</text>')
    col_every = max(1, math.ceil(n_cols / 10))
    for c in range(0, n_cols, col_every):
        body.append(f'<text x="{left + c * cell_w:.1f}" y="{grid_bottom + 16}" {TEXT}>'
                    f'{h.columns[c][0]}</text>')
    body.append(f'<text x="{left - 40}" y="{top - 6}" {TEXT}>rank</text>'
                f'<text x="{(left + width - right) / 2:.0f}" y="{grid_bottom + 32}" '
                f'text-anchor="middle" {TEXT}>step</text>')
    for c, (first, last) in enumerate(h.columns):
        if first <= marks.onset <= last:
            xpos = left + cell_w * (c + (marks.onset - first) / (last - first + 1))
            body.append(_marker(xpos, top - 14, grid_bottom, ONSET_COLOUR, "4 3",
                                f"onset {marks.onset}"))
    legend_y = grid_bottom + 44
    for i in range(10):
        body.append(f'<rect x="{left + i * 16}" y="{legend_y}" width="16" height="12" '
                    f'fill="{heat_colour(i / 9)}"/>')
    body.append(f'<text x="{left + 168}" y="{legend_y + 11}" {TEXT}>{escape(h.metric)}: '
                f'{fmt(lo)} (light) to {fmt(hi)} (dark); grey: nothing stored</text>')
    return _svg(width, height, f"per-rank {h.metric} by step", body)
