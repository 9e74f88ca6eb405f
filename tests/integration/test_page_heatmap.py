"""The incident page's heatmap from one grouped read (`Reader.rank_buckets`) is the heatmap
the page used to build with one `Reader.rank_scores` read per column, over chDB and over the
in-memory store; and the two stores answer `rank_buckets` alike.

The stores hold `storage.testing`'s sample data set (loaded into chDB by the integration
tier's `sample_store`) plus what the sample lacks for this question: incident windows longer
than the heatmap has columns (so a column spans several steps, the last one fewer) and a job
with more ranks than the heatmap has rows (so only the picked ranks are read).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from api.models import RankScore
from api.page.data import (
    KIND_METRIC,
    MAX_COLUMNS,
    MAX_RANKS,
    MAX_ROWS,
    RankMetric,
    heatmap,
    load,
    pick_ranks,
    window,
)
from api.page.svg import Heatmap
from schemas.wire import IncidentV1
from storage.client import ClickHouse
from storage.reader import RANK_FIGURES, Queries, Reader
from storage.testing import SAMPLE_JOB, MemoryStore, load_sample, make_incident, make_report
from storage.writer import Sink
from tests.integration.conftest import sample_store

pytestmark = pytest.mark.integration

WIDE_JOB = "team/wide"  # more ranks than the heatmap has rows
WIDE_RANKS = MAX_ROWS + 16
GPU = f"{SAMPLE_JOB}/gpu/rank:1/30"
METRICS: list[RankMetric] = [cast(RankMetric, c.name) for c in RANK_FIGURES]


def write_more(sink: Sink | MemoryStore) -> None:
    """Beyond the sample: a wide job whose rank 5 is slow from step 50, and incidents whose
    windows are wider than `MAX_COLUMNS` steps (2 steps a column, the last one short)."""
    for step in range(100):
        sink.add_report(
            make_report(WIDE_JOB, step, n_ranks=WIDE_RANKS, slow_rank=5 if step >= 50 else None)
        )
    sink.add_incident(make_incident(WIDE_JOB, culprit="rank:5", onset_step=50, last_step=99))
    sink.add_incident(
        make_incident(
            SAMPLE_JOB, culprit="rank:1", onset_step=25, last_step=59, incident_id="long/gpu"
        )
    )
    sink.add_incident(
        make_incident(
            SAMPLE_JOB,
            culprit="node:node-0",
            kind="host",
            onset_step=20,
            last_step=40,
            status="resolved",
            resolved_step=44,
            incident_id="long/host/resolved",
        )
    )
    sink.flush()


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Reader]]:
    """The same writes in chDB and in memory, by name."""
    path: Path = tmp_path_factory.mktemp("chdb")
    with sample_store(f"chdb://{path}?database=test_page_heatmap") as db:
        write_more(Sink(db))
        memory = MemoryStore()
        load_sample(memory)
        write_more(memory)
        yield {"chdb": Queries(db), "memory": memory}


@pytest.fixture(params=["chdb", "memory"])
def store(request: pytest.FixtureRequest, stores: dict[str, Reader]) -> Reader:
    return stores[request.param]


def incidents(store: Reader) -> list[IncidentV1]:
    return [msgspec.convert(r, IncidentV1) for r in store.incidents(limit=1000)]


def per_column(
    store: Reader, inc: IncidentV1, metric: RankMetric, lo: int, hi: int
) -> tuple[Heatmap, int]:
    """The heatmap as the page built it before `rank_buckets`: one `rank_scores` read per
    column (kept here, with its own column arithmetic, as the reference)."""
    whole = [
        RankScore.model_validate(r) for r in store.rank_scores(inc.job, lo, hi, limit=MAX_RANKS)
    ]
    ranks = pick_ranks(whole, metric, [s.entity for s in inc.suspects])
    width = max(1, math.ceil((hi - lo + 1) / MAX_COLUMNS))
    cols = [(a, min(a + width - 1, hi)) for a in range(lo, hi + 1, width)] if ranks else []
    row_of = {rank: i for i, rank in enumerate(ranks)}
    values: list[list[float | None]] = [[None] * len(cols) for _ in ranks]
    for c, (first, last) in enumerate(cols):
        for r in store.rank_scores(inc.job, first, last, limit=MAX_RANKS):
            score = RankScore.model_validate(r)
            if score.rank in row_of:
                values[row_of[score.rank]][c] = getattr(score, metric)
    return Heatmap(metric=metric, ranks=ranks, columns=cols, values=values), len(whole)


class CountingReader:
    """A reader passing every call through to another, counting the calls by method."""

    def __init__(self, inner: Reader) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted


class CountingClickHouse:
    """A ClickHouse client passing every call through, counting the queries it runs."""

    def __init__(self, inner: ClickHouse) -> None:
        self.inner = inner
        self.queries: list[str] = []

    def rows(self, sql: str, parameters: Any = None) -> list[dict[str, Any]]:
        self.queries.append(sql)
        return self.inner.rows(sql, parameters)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def cases(store: Reader) -> list[tuple[IncidentV1, RankMetric]]:
    """Every incident with the figure its page shows by default, and one whose columns span
    two steps with every figure (each per-column heatmap costs a read per column)."""
    found = incidents(store)
    return [(inc, KIND_METRIC[inc.kind]) for inc in found] + [
        (inc, metric) for inc in found if inc.id == "long/gpu" for metric in METRICS
    ]


def test_the_grouped_heatmap_is_the_per_column_one(store: Reader) -> None:
    widths = set()
    for inc, metric in cases(store):
        lo, hi = window(inc)
        got = heatmap(store, inc, metric, lo, hi)
        assert got == per_column(store, inc, metric, lo, hi), (inc.id, metric)
        widths.add(max((b - a + 1 for a, b in got[0].columns), default=0))
    assert {1, 2} <= widths  # columns of one step and of several were compared


def test_the_slow_rank_of_a_wide_job_is_shown_and_columns_span_steps(store: Reader) -> None:
    data = load(store, f"{WIDE_JOB}/gpu/rank:5/50")
    assert data is not None and data.ranks_in_job == WIDE_RANKS
    heat = data.heatmap
    assert len(heat.ranks) == MAX_ROWS and 5 in heat.ranks
    assert heat.columns[0] == (25, 26) and heat.columns[-1] == (99, 99)
    slow = heat.values[heat.ranks.index(5)]
    assert slow[0] == pytest.approx(1.0) and slow[-1] == pytest.approx(1.5)
    assert all(v is not None for row in heat.values for v in row)


def test_a_page_reads_the_heatmap_in_one_grouped_read(store: Reader) -> None:
    for incident_id in (GPU, f"{WIDE_JOB}/gpu/rank:5/50"):
        counting = CountingReader(store)
        data = load(cast(Reader, counting), incident_id)
        assert data is not None and len(data.heatmap.columns) > 30
        # rank_scores once over the whole window (it picks the rows), not once per column
        assert counting.calls == {"incident": 1, "steps": 1, "rank_scores": 1, "rank_buckets": 1}


def test_a_page_over_clickhouse_runs_one_query_for_the_heatmaps_cells(
    stores: dict[str, Reader],
) -> None:
    chdb = stores["chdb"]
    assert isinstance(chdb, Queries)
    counting = CountingClickHouse(chdb.db)
    data = load(Queries(cast(ClickHouse, counting)), GPU)
    assert data is not None and len(data.heatmap.columns) == 45
    assert len(counting.queries) == 4  # the incident, its steps, the rows' ranks, the cells
    grouped = [q for q in counting.queries if "intDiv" in q]
    assert len(grouped) == 1 and "GROUP BY rank, bucket" in grouped[0]


def test_an_incident_without_rank_figures_reads_no_cells(store: Reader) -> None:
    inc = make_incident("no/ranks", culprit="rank:0", kind="gpu")
    counting = CountingReader(store)
    heat, n_ranks = heatmap(cast(Reader, counting), inc, KIND_METRIC["gpu"], *window(inc))
    assert n_ranks == 0 and heat == Heatmap("compute_ratio", [], [], [])
    assert counting.calls == {"rank_scores": 1}


BUCKET_READS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((SAMPLE_JOB, 0, 59, MAX_COLUMNS, "compute_ratio"), {}),
    ((SAMPLE_JOB, 3, 50, 5, "gap_s"), {}),  # 10 steps a bucket, the last one 8
    ((SAMPLE_JOB, 15, 59, 7, "caused_wait_s"), {"ranks": [3, 1]}),
    ((SAMPLE_JOB, 0, 59, 1, "step_s"), {}),  # one bucket: rank_scores' averages
    ((SAMPLE_JOB, 25, 34, 4, "wait_s"), {"limit": 5}),
    ((WIDE_JOB, 25, 99, MAX_COLUMNS, "compute_ratio"), {"ranks": [0, 5, WIDE_RANKS - 1]}),
    ((WIDE_JOB, 0, 99, 9, "comm_s"), {}),
    (("quiet", 0, 9, 48, "compute_s"), {}),
    ((SAMPLE_JOB, 0, 59, 4, "compute_ratio"), {"ranks": []}),
    ((SAMPLE_JOB, 999, 1000, 4, "compute_ratio"), {}),
    (("nope", 0, 10, 4, "compute_ratio"), {}),
]


@pytest.mark.parametrize(
    ("args", "kwargs"), BUCKET_READS, ids=[f"rank_buckets{i}" for i in range(len(BUCKET_READS))]
)
def test_both_stores_bucket_alike(
    stores: dict[str, Reader], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    expected = stores["chdb"].rank_buckets(*args, **kwargs)
    assert stores["memory"].rank_buckets(*args, **kwargs) == expected
    if args[0] != "nope" and args[1] < 100 and kwargs.get("ranks") != []:
        assert expected


def test_one_bucket_is_rank_scores_over_the_range(store: Reader) -> None:
    scores = store.rank_scores(SAMPLE_JOB, 20, 44)
    for metric in METRICS:
        cells = store.rank_buckets(SAMPLE_JOB, 20, 44, 1, metric)
        assert cells == [{"rank": s["rank"], "bucket": 0, "value": s[metric]} for s in scores]


def test_both_stores_draw_the_same_heatmaps(stores: dict[str, Reader]) -> None:
    chdb, memory = stores["chdb"], stores["memory"]
    for inc, metric in cases(chdb):
        lo, hi = window(inc)
        assert heatmap(chdb, inc, metric, lo, hi) == heatmap(memory, inc, metric, lo, hi), (
            inc.id,
            metric,
        )
