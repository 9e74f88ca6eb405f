"""api.page.svg: the step-time chart and the heatmap, read back as SVG."""

from __future__ import annotations

import math
import re

import pytest

from api.page.svg import (
    HEAT_HIGH,
    HEAT_LOW,
    NO_DATA,
    ONSET_COLOUR,
    RESOLVED_COLOUR,
    STEP_COLOUR,
    Heatmap,
    Markers,
    StepSample,
    heat_colour,
    heatmap_chart,
    nice_ticks,
    step_chart,
)

MARKS = Markers(onset=30, opened=33, resolved=None)


def polylines(svg: str, colour: str) -> list[list[tuple[float, float]]]:
    lines = re.findall(rf'<polyline points="([^"]+)" fill="none" stroke="{colour}"', svg)
    return [[tuple(map(float, p.split(","))) for p in line.split()] for line in lines]


def marker_x(svg: str, colour: str, label: str) -> float:
    """The x of the marker line drawn just before its label."""
    m = re.search(rf'<line x1="([\d.]+)"[^>]*stroke="{colour}"[^>]*/><text[^>]*>'
                  rf"{re.escape(label)}</text>", svg)
    assert m, f"no marker {label!r}"
    return float(m.group(1))


def samples(n: int = 60, onset: int = 30) -> list[StepSample]:
    return [StepSample(s, 1.2 if s >= onset else 1.0, 1.0) for s in range(n)]


@pytest.mark.parametrize(("lo", "hi", "want"), [
    (0.0, 1.0, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]),
    (0.93, 1.57, [1.0, 1.2, 1.4]),
    (15, 59, [20, 30, 40, 50]),
    (2.0, 2.0, [2.0]),
    (1.0, 0.0, []),
    (0.0, math.nan, []),
])
def test_ticks_are_round_and_inside_the_range(lo: float, hi: float, want: list[float]) -> None:
    assert nice_ticks(lo, hi, 5) == pytest.approx(want)


def test_heat_colours_run_from_light_to_dark_and_clamp() -> None:
    hexed = ["#{:02x}{:02x}{:02x}".format(*c) for c in (HEAT_LOW, HEAT_HIGH)]
    assert heat_colour(0.0) == heat_colour(-3) == hexed[0]
    assert heat_colour(1.0) == heat_colour(7) == hexed[1]
    assert heat_colour(0.5) not in hexed


def test_step_chart_marks_the_onset_between_the_steps_around_it() -> None:
    svg = step_chart(samples(), MARKS)
    (line,) = polylines(svg, STEP_COLOUR)
    assert len(line) == 60
    x_of = {step: x for step, (x, _) in zip(range(60), line, strict=True)}
    assert marker_x(svg, ONSET_COLOUR, "onset 30") == pytest.approx(x_of[30], abs=0.1)
    assert x_of[33] == pytest.approx(marker_x(svg, ONSET_COLOUR, "opened 33"), abs=0.1)
    assert "resolved" not in svg
    # higher step time is higher on the page (smaller y)
    assert line[40][1] < line[10][1]
    assert len(polylines(svg, "#8c8c8c")) == 1  # the baseline


def test_step_chart_shows_a_resolution_and_markers_outside_the_data() -> None:
    svg = step_chart(samples(20, onset=5), Markers(onset=5, opened=5, resolved=40))
    assert "opened" not in svg  # opened at the onset: one marker says it
    resolved = marker_x(svg, RESOLVED_COLOUR, "resolved 40")
    (line,) = polylines(svg, STEP_COLOUR)
    assert resolved > line[-1][0]  # the axis reaches the resolution past the last step


def test_a_missing_step_time_breaks_the_line() -> None:
    data = samples(10)
    data[4] = StepSample(4, None, None)
    data[9] = StepSample(9, None, 1.0)
    lines = polylines(step_chart(data, Markers(3, 3, None)), STEP_COLOUR)
    assert [len(line) for line in lines] == [4, 4]


def test_step_chart_without_any_time_says_so() -> None:
    for data in ([], [StepSample(1, None, 1.0)]):
        svg = step_chart(data, MARKS)
        assert "no step times stored" in svg and "<polyline" not in svg


def grid(metric: str = "compute_ratio") -> Heatmap:
    cols = [(0, 9), (10, 19), (20, 29), (30, 39)]
    values: list[list[float | None]] = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.5, 1.5],
                                        [None, 1.0, 1.0, 1.0]]
    return Heatmap(metric=metric, ranks=[0, 1, 7], columns=cols, values=values)


def cells(svg: str) -> list[tuple[str, str]]:
    """(fill, tooltip) of every heatmap cell, row by row."""
    return re.findall(r'<rect [^>]*fill="(#[0-9a-f]{6})"><title>([^<]*)</title></rect>', svg)


def test_heatmap_colours_each_rank_and_range_and_greys_what_is_missing() -> None:
    svg = heatmap_chart(grid(), Markers(onset=25, opened=26, resolved=None))
    got = cells(svg)
    assert len(got) == 12
    dark, light = heat_colour(1.0), heat_colour(0.0)
    assert [f for f, _ in got[4:8]] == [light, light, dark, dark]  # rank 1, slow from 20
    assert got[8] == (NO_DATA, "rank 7, steps 0–9: nothing stored")
    assert got[6][1] == "rank 1, steps 20–29: compute_ratio 1.5"
    # the onset (25) is half-way into the third column
    first_x = [float(x) for x in re.findall(r'<rect x="([\d.]+)" y="20"', svg)[:4]]
    assert marker_x(svg, ONSET_COLOUR, "onset 25") == pytest.approx(
        (first_x[2] + first_x[3]) / 2, abs=0.2)


def test_a_flat_heatmap_is_all_light() -> None:
    flat = Heatmap("gap_s", [0, 1], [(0, 4)], [[0.5], [0.5]])
    assert {f for f, _ in cells(heatmap_chart(flat, MARKS))} == {heat_colour(0.0)}


def test_heatmap_escapes_its_texts() -> None:
    svg = heatmap_chart(grid('<script>"x"</script>'), MARKS)
    assert "<script>" not in svg and "&lt;script&gt;&quot;x&quot;" in svg


@pytest.mark.parametrize("heat", [
    Heatmap("compute_ratio", [], [], []),
    Heatmap("compute_ratio", [0], [(0, 9)], [[None]]),
])
def test_heatmap_without_figures_says_so(heat: Heatmap) -> None:
    svg = heatmap_chart(heat, MARKS)
    assert "no per-rank figures stored" in svg and "<title>" not in svg
