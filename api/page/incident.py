"""The incident page as HTML: what broke, since when, what it costs, who is suspected, the
plots, and a hang's merged stacks.

Built with f-strings over `html.escape`d values (every text from the store is escaped; URLs
are same-origin paths with the id percent-encoded), with its style inline and no script:
the page opens offline, and a Content-Security-Policy from the route holds it to that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from html import escape
from typing import get_args
from urllib.parse import quote, urlencode

from api.models import StepPoint
from api.page.data import PageData, RankMetric, window
from api.page.svg import Markers, StepSample, heatmap_chart, step_chart
from schemas.wire import IncidentV1, StackGroup

NS_PER_S = 1_000_000_000
STYLE = """
body{font-family:sans-serif;margin:24px;max-width:1040px;color:#222}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.badge{display:inline-block;padding:2px 8px;border-radius:10px;color:#fff;font-size:13px}
.open{background:#d62728}.resolved{background:#2ca02c}
table{border-collapse:collapse}td,th{padding:3px 12px 3px 0;text-align:left;vertical-align:top}
th{color:#555;font-weight:normal}.bar{background:#9467bd;height:10px}
.barbox{width:200px;background:#eee}pre{background:#f6f6f6;padding:8px;overflow-x:auto}
.muted{color:#666;font-size:13px}a{color:#1f5fa0}
"""


def when(ns: int | None) -> str:
    """Nanoseconds since the epoch as a UTC time a person reads; '' when unknown."""
    if ns is None or ns <= 0:
        return ""
    return datetime.fromtimestamp(ns / NS_PER_S, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def num(v: float | None, digits: int = 2) -> str:
    """A stored figure; NaN and inf (an estimate that could not be made) read 'unknown'."""
    return "unknown" if v is None or not math.isfinite(v) else f"{v:,.{digits}f}"


def incident_path(incident_id: str) -> str:
    """The page's own path (and the alert links' form): the id keeps its slashes and colons."""
    return f"/incidents/{quote(incident_id, safe='/:')}"


def _step_ts(steps: Sequence[StepPoint], step: int) -> int | None:
    """The time of `step`, or of the first stored step after it (a strided series)."""
    return next((p.ts_ns for p in steps if p.step >= step), None)


def _rows(pairs: list[tuple[str, str]]) -> str:
    """A two-column table; the values are HTML already (escaped by the caller)."""
    return "<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{v}</td></tr>"
                                for k, v in pairs) + "</table>"


def _since(inc: IncidentV1, steps: Sequence[StepPoint]) -> str:
    onset_at = when(_step_ts(steps, inc.onset_step))
    end = (f"resolved at step {inc.resolved_step}" if inc.resolved_step is not None
           else "still open")
    return _rows([
        ("onset", f"step {inc.onset_step}" + (f" ({escape(onset_at)})" if onset_at else "")),
        ("opened", f"step {inc.opened_step} ({escape(when(inc.opened_ts_ns)) or 'unknown'})"),
        ("latest evidence", f"step {inc.last_step}"),
        ("status", escape(end)),
        ("evidence", f"{inc.evidence_steps} steps"),
    ])


def _cost(inc: IncidentV1) -> str:
    total = inc.lost_gpu_seconds
    hours = f" ({num(total / 3600)} GPU-hours)" if math.isfinite(total) else ""
    return _rows([
        ("slowdown", f"×{num(inc.slowdown)} (the job's step time over its step time without "
         "the culprit)" if math.isfinite(inc.slowdown) else "unknown"),
        ("lost per step", f"{num(inc.lost_gpu_seconds_per_step)} GPU-seconds"),
        ("lost in total", f"{num(total)} GPU-seconds{hours}"),
    ])


def _suspects(inc: IncidentV1) -> str:
    if not inc.suspects:
        return '<p class="muted">no suspects recorded</p>'
    rows = []
    for s in inc.suspects:
        pct = 100 * min(max(s.confidence, 0.0), 1.0) if math.isfinite(s.confidence) else 0
        rows.append(f'<tr><td>{escape(s.entity)}</td><td>{num(s.confidence)}</td>'
                    f'<td><div class="barbox"><div class="bar" style="width:{pct:.0f}%">'
                    '</div></div></td></tr>')
    return ("<table><tr><th>suspect</th><th>confidence</th><th></th></tr>" + "".join(rows)
            + "</table>")


def _stacks(groups: list[StackGroup]) -> str:
    parts = []
    for g in groups:
        head = (f"{escape(g.thread)} thread: ranks {escape(g.ranks)} ({g.n_ranks})"
                + (f"; not there: {escape(g.not_ranks)}" if g.not_ranks else ""))
        note = f'<p class="muted">{escape(g.note)}</p>' if g.note else ""
        frames = "\n".join(escape(f) for f in g.frames) or "(no frames)"
        parts.append(f"<details open><summary>{head}</summary>{note}<pre>{frames}</pre>"
                     "</details>")
    return "".join(parts)


def _metric_links(incident_id: str, current: str) -> str:
    links = []
    for m in get_args(RankMetric):
        if m == current:
            links.append(f"<b>{escape(m)}</b>")
        else:
            href = f"{incident_path(incident_id)}?{urlencode({'metric': m})}"
            links.append(f'<a href="{escape(href)}">{escape(m)}</a>')
    return '<p class="muted">colour by: ' + " · ".join(links) + "</p>"


def render_incident(data: PageData) -> str:
    """The whole page of one incident."""
    inc, steps, heat = data.incident, data.steps, data.heatmap
    marks = Markers(onset=inc.onset_step, opened=inc.opened_step, resolved=inc.resolved_step)
    samples = [StepSample(p.step, p.step_time_s, p.baseline_s) for p in steps]
    lo, hi = window(inc)
    json_href = f"/v1/incidents/{quote(inc.id, safe='/:')}"
    job_href = f"/v1/jobs/{quote(inc.job, safe='/:')}"
    shown = (f"{len(heat.ranks)} of {data.ranks_in_job} ranks (the suspects, then the farthest "
             "from the median)" if len(heat.ranks) < data.ranks_in_job
             else f"all {len(heat.ranks)} ranks")
    sections = [
        f'<h1>{escape(inc.summary or inc.culprit)}</h1>'
        f'<p><span class="badge {escape(inc.status)}">{escape(inc.status)}</span> '
        f'{escape(inc.kind)} incident on <b>{escape(inc.culprit)}</b> in job '
        f'<a href="{escape(job_href)}">{escape(inc.job)}</a> · '
        f'<a href="{escape(json_href)}">JSON</a></p>'
        f'<p class="muted">id {escape(inc.id)}</p>',
        "<h2>What broke</h2>" + _rows([
            ("kind", escape(inc.kind)), ("culprit", escape(inc.culprit)),
            ("summary", escape(inc.summary)),
        ]),
        "<h2>Since when</h2>" + _since(inc, steps),
        "<h2>What it costs</h2>" + _cost(inc),
        "<h2>Suspects</h2>" + _suspects(inc),
        f'<h2>Step time</h2><p class="muted">steps {lo}–{hi}'
        + (f", one step in {steps[1].step - steps[0].step} shown" if len(steps) > 1
           and steps[1].step - steps[0].step > 1 else "") + "</p>"
        + step_chart(samples, marks),
        f"<h2>Per-rank {escape(heat.metric)}</h2>"
        f'<p class="muted">{escape(shown)}, averaged over each column\'s steps</p>'
        + heatmap_chart(heat, marks) + _metric_links(inc.id, heat.metric),
    ]
    if inc.stacks:
        sections.append("<h2>Stacks</h2><p class=\"muted\">every rank's Python stacks merged, "
                        "the rarest first</p>" + _stacks(inc.stacks))
    return _document(f"{inc.kind} incident: {inc.culprit}", "".join(sections))


def render_problem(status: int, title: str, detail: str) -> str:
    """An error as a small page (the page's answer for a browser; /v1 answers problem+json)."""
    return _document(title, f"<h1>{status} {escape(title)}</h1><p>{escape(detail)}</p>"
                     '<p><a href="/v1/incidents">the incidents</a></p>')


def _document(title: str, body: str) -> str:
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{escape(title)} · Flare</title><style>{STYLE}</style></head>"
            f"<body>{body}</body></html>")
