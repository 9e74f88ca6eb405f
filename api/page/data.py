"""What the incident page shows, asked of the store with the reads the /v1 routes use.

The page shows the incident from a little before its onset (so the change is visible) to its
end, at most `MAX_POINTS` steps of step time and a heatmap of at most `MAX_ROWS` ranks ×
`MAX_COLUMNS` step ranges: a page for 10,000 ranks over 100,000 steps stays a page. When the
job has more ranks than rows, the rows are the suspects' ranks first, then the ranks farthest
from the job's median over the window: the odd ones out are the point of the picture.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal

import msgspec

from api.models import RankScore, StepPoint
from api.page.svg import Heatmap
from schemas.wire import IncidentV1
from storage.reader import Reader, Row, bucket_width

MAX_POINTS = 600
MAX_ROWS = 48
MAX_COLUMNS = 48
MAX_RANKS = 100_000  # as /v1/jobs/{job}/ranks allows
MIN_CONTEXT = 10  # steps shown before the onset, at least

# A per-rank figure of `Reader.rank_scores` and `Reader.rank_buckets` (tests hold this equal
# to storage.reader's RANK_FIGURES): what the heatmap colours.
RankMetric = Literal["step_s", "compute_s", "comm_s", "gap_s", "wait_s", "caused_wait_s",
                     "compute_ratio"]
# The figure that shows each kind of fault: a slow GPU computes longer than its peers, a
# stalled host leaves gaps between ops, a slow link or switch makes communication longer, a
# hang's ranks wait for the one that stopped, a job-wide shift slows every step.
KIND_METRIC: dict[str, RankMetric] = {
    "gpu": "compute_ratio", "node": "compute_ratio", "host": "gap_s", "link": "comm_s",
    "switch": "comm_s", "hang": "caused_wait_s", "job": "step_s",
}


@dataclass(frozen=True, slots=True)
class PageData:
    incident: IncidentV1  # the wire shape: typed, and the page formats NaN itself
    steps: list[StepPoint]
    heatmap: Heatmap
    ranks_in_job: int  # ranks with figures in the window; the heatmap shows up to MAX_ROWS


def window(inc: IncidentV1) -> tuple[int, int]:
    """The steps shown: onset to end, with half the incident's length (at least
    `MIN_CONTEXT` steps) before the onset, and as much after a resolution."""
    end = max(inc.last_step, inc.resolved_step or 0, inc.onset_step)
    context = max(MIN_CONTEXT, (end - inc.onset_step + 1) // 2)
    lo = max(0, inc.onset_step - context)
    return lo, end + (context if inc.resolved_step is not None else 0)


def columns(lo: int, hi: int, n: int = MAX_COLUMNS) -> list[tuple[int, int]]:
    """[lo, hi] cut into at most `n` equal step ranges (the last may be shorter): the
    buckets `Reader.rank_buckets` groups by, as the heatmap labels them."""
    width = bucket_width(lo, hi, n)
    return [(a, min(a + width - 1, hi)) for a in range(lo, hi + 1, width)]


def pick_ranks(scores: list[RankScore], metric: RankMetric, suspects: list[str],
               limit: int = MAX_ROWS) -> list[int]:
    """The ranks the heatmap shows, in rank order: all of them when they fit; otherwise
    the ranks named by a suspect (`rank:3`, or any rank of `node:n7`), then those whose
    figure is farthest from the median."""
    if len(scores) <= limit:
        return sorted(s.rank for s in scores)
    named = {int(e[5:]) for e in suspects if e.startswith("rank:") and e[5:].isdigit()}
    nodes = {e[5:] for e in suspects if e.startswith("node:")}
    figures = [(s, getattr(s, metric)) for s in scores]
    finite = [v for _, v in figures if v is not None]
    mid = statistics.median(finite) if finite else 0.0

    def priority(item: tuple[RankScore, float | None]) -> tuple[bool, float, int]:
        s, v = item
        suspect = s.rank in named or s.node in nodes
        return (not suspect, -abs(v - mid) if v is not None else 0.0, s.rank)

    return sorted(s.rank for s, _ in sorted(figures, key=priority)[:limit])


def heatmap(store: Reader, inc: IncidentV1, metric: RankMetric, lo: int, hi: int
            ) -> tuple[Heatmap, int]:
    """The heatmap over [lo, hi] and how many ranks the job has there. Two reads whatever
    the number of columns: the per-rank figures over the whole window (averaged as
    /v1/jobs/{job}/ranks does) pick the rows, then one grouped read averages the figure per
    shown rank and column."""
    whole = [RankScore.model_validate(r)
             for r in store.rank_scores(inc.job, lo, hi, limit=MAX_RANKS)]
    ranks = pick_ranks(whole, metric, [s.entity for s in inc.suspects])
    if not ranks:
        return Heatmap(metric=metric, ranks=[], columns=[], values=[]), len(whole)
    cols = columns(lo, hi)
    cells = store.rank_buckets(inc.job, lo, hi, MAX_COLUMNS, metric, ranks=ranks,
                               limit=len(ranks) * len(cols))
    return Heatmap(metric=metric, ranks=ranks, columns=cols,
                   values=grid(cells, ranks, len(cols))), len(whole)


def grid(cells: list[Row], ranks: list[int], n_columns: int) -> list[list[float | None]]:
    """`Reader.rank_buckets` rows as the heatmap's rows (one per rank, in `ranks` order) and
    columns; None where a rank has no steps in a column or its figure is not finite (NaN or
    ±inf: the page draws no colour for them, as the API shows them as null)."""
    row_of = {rank: i for i, rank in enumerate(ranks)}
    values: list[list[float | None]] = [[None] * n_columns for _ in ranks]
    for cell in cells:
        value = cell["value"]
        if value is not None and math.isfinite(value):
            values[row_of[cell["rank"]]][cell["bucket"]] = value
    return values


def load(store: Reader, incident_id: str, metric: RankMetric | None = None
         ) -> PageData | None:
    """Everything the page of `incident_id` shows, or None for an unknown incident."""
    row = store.incident(incident_id)
    if row is None:
        return None
    inc = msgspec.convert(row, IncidentV1)
    lo, hi = window(inc)
    stride = max(1, math.ceil((hi - lo + 1) / MAX_POINTS))
    steps = [StepPoint.model_validate(r) for r in
             store.steps(inc.job, from_step=lo, to_step=hi, limit=MAX_POINTS, stride=stride)]
    heat, n_ranks = heatmap(store, inc, metric or KIND_METRIC[inc.kind], lo, hi)
    return PageData(incident=inc, steps=steps, heatmap=heat, ranks_in_job=n_ranks)
