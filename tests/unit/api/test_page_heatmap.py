"""api.page.data's heatmap cells from `Reader.rank_buckets` rows, and the reader's bucket
arithmetic and figure names (tests/integration/test_page_heatmap.py holds the grouped read to
the per-column reads it replaced, over chDB and in memory)."""

from __future__ import annotations

import pytest

from api.page.data import MAX_COLUMNS, columns, grid
from storage.reader import RANK_FIGURES, bucket_width, rank_figure
from storage.testing import SAMPLE_JOB, MemoryStore


def test_cells_land_in_their_ranks_row_and_column() -> None:
    cells = [
        {"rank": 3, "bucket": 0, "value": 0.5},
        {"rank": 3, "bucket": 2, "value": float("nan")},  # not finite: drawn as no data
        {"rank": 7, "bucket": 1, "value": float("inf")},
        {"rank": 7, "bucket": 2, "value": 2.25},
    ]
    assert grid(cells, [3, 7], 3) == [[0.5, None, None], [None, None, 2.25]]
    assert grid([], [3], 2) == [[None, None]]


@pytest.mark.parametrize(
    ("lo", "hi", "n"),
    [(0, 9, 4), (5, 5, 48), (15, 59, 48), (0, 59, 48), (15, 1014, 48), (3, 50, 5)],
)
def test_the_page_columns_are_the_stores_buckets(lo: int, hi: int, n: int) -> None:
    width = bucket_width(lo, hi, n)
    cols = columns(lo, hi, n)
    assert len(cols) <= n and cols[0][0] == lo and cols[-1][1] == hi
    for b, (first, last) in enumerate(cols):
        assert {(step - lo) // width for step in range(first, last + 1)} == {b}


def test_only_rank_figures_and_positive_bucket_counts_are_asked() -> None:
    assert [rank_figure(c.name) for c in RANK_FIGURES] == [c.name for c in RANK_FIGURES]
    with pytest.raises(ValueError, match="expected one of"):
        rank_figure("rank) FROM system.tables --")
    with pytest.raises(ValueError, match="at least one bucket"):
        bucket_width(0, 9, 0)
    store = MemoryStore()
    with pytest.raises(ValueError, match="expected one of"):
        store.rank_buckets(SAMPLE_JOB, 0, 59, MAX_COLUMNS, "node")
