"""Write a scenario as a recorded stream (.jsonl, DESIGN §3) plus its ground truth.

The recording is `flare replay`'s and `flare diagnose`'s input; the truth file next to it,
`<stem>.truth.json`, is what `flare eval` scores against. The recording goes through the one
recording writer (`producers.recording.write_events`); both files are written to a temporary
name first and renamed, so an interrupted run never leaves a truncated file that looks whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from producers.recording import write_events
from producers.simulator.scenario import GroundTruth, Scenario
from producers.simulator.simulator import ClusterSimulator
from schemas import topics


def truth_path(recording: Path) -> Path:
    """run.jsonl -> run.truth.json"""
    return recording.with_name(recording.stem + ".truth.json")


def write_recording(
    scenario: Scenario, path: Path, on_step: Callable[[int], None] | None = None
) -> GroundTruth:
    """Write every message of the run to `path` and the ground truth next to it.

    `on_step(step)` is called the first time a message of each step is written (progress).
    """
    return write_simulation(ClusterSimulator(scenario), path, on_step)


def write_simulation(
    sim: ClusterSimulator, path: Path, on_step: Callable[[int], None] | None = None
) -> GroundTruth:
    """`write_recording` for an already built simulator (its errors were raised at build)."""
    path = Path(path)
    events = sim.events() if on_step is None else _reporting(sim.events(), on_step)
    write_events(events, path)
    truth = sim.truth
    tpath = truth_path(path)
    ttmp = tpath.with_name(tpath.name + ".tmp")
    ttmp.write_bytes(orjson.dumps(truth.to_dict(), option=orjson.OPT_INDENT_2) + b"\n")
    ttmp.replace(tpath)
    return truth


def _reporting(
    events: Iterable[tuple[str, str, Any, int]], on_step: Callable[[int], None]
) -> Iterator[tuple[str, str, Any, int]]:
    """The events unchanged; `on_step` once a step's first message has been written."""
    seen = -1
    for event in events:
        yield event  # the writer writes it before asking for the next one
        topic, _key, value, _ts = event
        if topic == topics.STEPS and value["step"] > seen:
            seen = value["step"]
            on_step(seen)


def read_truth(path: Path) -> GroundTruth:
    """The ground truth of a recording (pass the .jsonl or the .truth.json itself)."""
    path = Path(path)
    if not path.name.endswith(".truth.json"):
        path = truth_path(path)
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a ground truth is a JSON object")
    return GroundTruth.from_dict(data)
