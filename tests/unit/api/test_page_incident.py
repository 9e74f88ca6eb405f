"""api.page.data and api.page.incident: what the incident page asks of the store and shows,
over the in-memory store holding the sample data set."""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest

from api.models import RankScore
from api.page.data import (
    KIND_METRIC,
    MAX_ROWS,
    RankMetric,
    columns,
    load,
    pick_ranks,
    window,
)
from api.page.incident import incident_path, render_incident, when
from schemas.wire import IncidentKind, StackGroup
from storage.reader import RANK_FIGURES
from storage.testing import SAMPLE_JOB, MemoryStore, make_incident, step_ts

GPU = f"{SAMPLE_JOB}/gpu/rank:1/30"  # load_sample: rank 1 slow from step 30, open
LINK = f"{SAMPLE_JOB}/link/node:node-1/5"  # resolved at step 20


def test_every_rank_figure_and_every_kind_has_a_heatmap_metric() -> None:
    assert set(get_args(RankMetric)) == {c.name for c in RANK_FIGURES}
    assert set(KIND_METRIC) == set(get_args(IncidentKind))


@pytest.mark.parametrize(("onset", "last", "resolved", "want"), [
    (30, 59, None, (15, 59)),  # half the incident before the onset
    (3, 4, None, (0, 4)),  # at least 10 steps before, not below step 0
    (5, 12, 20, (0, 30)),  # as much again after a resolution
    (1000, 1000, None, (990, 1000)),
])
def test_the_window_shows_the_change_around_the_onset(
        onset: int, last: int, resolved: int | None, want: tuple[int, int]) -> None:
    inc = make_incident("j", onset_step=onset, opened_step=onset, last_step=last,
                        resolved_step=resolved,
                        status="resolved" if resolved is not None else "open")
    assert window(inc) == want


def test_columns_cover_the_window_without_overlap() -> None:
    assert columns(0, 9, 4) == [(0, 2), (3, 5), (6, 8), (9, 9)]
    assert columns(5, 5, 4) == [(5, 5)]
    cols = columns(15, 1014, 48)
    assert cols[0][0] == 15 and cols[-1][1] == 1014 and len(cols) <= 48
    assert all(b + 1 == c for (_, b), (c, _) in zip(cols, cols[1:], strict=False))


def score(rank: int, ratio: float, node: str = "n0") -> RankScore:
    return RankScore.model_validate({
        "rank": rank, "node": node, "steps": 1, "step_s": 1.0, "compute_s": ratio,
        "comm_s": 0.1, "gap_s": 0.0, "wait_s": 0.0, "caused_wait_s": 0.0,
        "caused_wait_total_s": 0.0, "compute_ratio": ratio, "min_compute_ratio": ratio})


def test_many_ranks_show_the_suspects_then_the_odd_ones_out() -> None:
    scores = [score(r, 1.0, node=f"n{r // 8}") for r in range(200)]
    scores[150] = score(150, 1.9, node="n18")  # the farthest from the median
    scores[3] = score(3, 0.5)
    picked = pick_ranks(scores, "compute_ratio", ["rank:77", "node:n20", "job"], limit=12)
    assert len(picked) == 12 and picked == sorted(picked)
    assert {77, *range(160, 168), 150, 3} <= set(picked)
    few = pick_ranks(scores[:5], "compute_ratio", [], limit=MAX_ROWS)
    assert few == [0, 1, 2, 3, 4]


def test_the_heatmap_shows_the_slow_rank_from_the_onset(store: MemoryStore) -> None:
    data = load(store, GPU)
    assert data is not None and data.heatmap.metric == "compute_ratio"
    heat = data.heatmap
    assert heat.ranks == [0, 1, 2, 3] and data.ranks_in_job == 4
    assert heat.columns[0][0] == 15 and heat.columns[-1][1] == 59
    slow = heat.values[1]
    for (first, last), v in zip(heat.columns, slow, strict=True):
        assert v == pytest.approx(1.5 if first >= 30 else 1.0), (first, last)
    assert all(v == pytest.approx(1.0) for v in heat.values[0])
    assert [p.step for p in data.steps] == list(range(15, 60))
    gap = load(store, GPU, "gap_s")
    assert gap is not None and gap.heatmap.values[3][0] == pytest.approx(0.03)


def test_an_unknown_incident_loads_nothing(store: MemoryStore) -> None:
    assert load(store, "no/such") is None


def page(store: MemoryStore, incident_id: str) -> str:
    data = load(store, incident_id)
    assert data is not None
    return render_incident(data)


def test_the_page_says_what_broke_since_when_and_what_it_costs(store: MemoryStore) -> None:
    html = page(store, GPU)
    for text in ("rank:1 computes 50% slower than its peers", "gpu", "open",
                 f"step 30 ({when(step_ts(30))})", f"step 33 ({when(step_ts(33))})",
                 "still open", "×1.30", "1.50 GPU-seconds", "12.50 GPU-seconds",
                 "node:node-0</td><td>0.10", "rank:1</td><td>0.90",
                 "onset 30", "Per-rank compute_ratio", "all 4 ranks"):
        assert text in html, text
    assert "Stacks" not in html
    assert "http://" not in html and "https://" not in html and "<script" not in html
    assert f'href="/v1/incidents/{GPU}"' in html
    assert f'href="{incident_path(GPU)}?metric=gap_s"' in html


def test_a_resolved_incident_says_when(store: MemoryStore) -> None:
    html = page(store, LINK)
    assert "resolved at step 20" in html and "resolved 20" in html
    assert "Per-rank comm_s" in html


def test_every_stored_text_is_escaped() -> None:
    store = MemoryStore()
    evil = '<script>alert("x")</script>'
    inc = make_incident('j"<b>', culprit="rank:1", kind="hang", incident_id=f"id/{evil}")
    inc = msgspec.structs.replace(inc, summary=evil, stacks=[
        StackGroup(thread=evil, frames=[f"a.py:1 in {evil}"], ranks="1", n_ranks=1,
                   not_ranks="0", note=evil)])
    store.add_incident(inc)
    store.flush()
    html = page(store, inc.id)
    assert "<script" not in html and 'j"<b>' not in html and "j&quot;&lt;b&gt;" in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    assert html.count("&lt;script&gt;") >= 5  # title, summary, thread, note, frame
    # a job with nothing stored: the plots say so instead of drawing
    assert "no step times stored" in html and "no per-rank figures stored" in html


def test_a_hangs_stacks_are_shown_rarest_first() -> None:
    store = MemoryStore()
    inc = msgspec.structs.replace(
        make_incident("j", culprit="rank:2", kind="hang"), stacks=[
            StackGroup(thread="training", frames=["t.py:1 in main", "t.py:9 in barrier"],
                       ranks="2", n_ranks=1, not_ranks="0-1,3"),
            StackGroup(thread="training", frames=[], ranks="0-1,3", n_ranks=3,
                       not_ranks="2", note="no answer")])
    store.add_incident(inc)
    store.flush()
    html = page(store, inc.id)
    assert "<h2>Stacks</h2>" in html
    assert html.index("ranks 2 (1); not there: 0-1,3") < html.index("ranks 0-1,3 (3)")
    assert "t.py:1 in main\nt.py:9 in barrier" in html and "(no frames)" in html
    assert "no answer" in html and "Per-rank caused_wait_s" in html


def test_costs_that_could_not_be_estimated_read_unknown() -> None:
    store = MemoryStore()
    inc = msgspec.structs.replace(make_incident("j", lost_gpu_seconds=float("nan")),
                                  slowdown=float("inf"), lost_gpu_seconds_per_step=float("nan"))
    store.add_incident(inc)
    store.flush()
    html = page(store, inc.id)
    assert "<td>unknown</td>" in html  # the slowdown
    assert html.count("unknown GPU-seconds") == 2 and "nan" not in html and "inf" not in html
