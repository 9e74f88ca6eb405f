"""Recorded streams: every line read back as an event, bad lines named, the writer's lines."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from producers.recording import (
    RecordingError,
    read_recording,
    recording_events,
    recording_line,
    write_events,
)


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_recording_lines_become_events(tmp_path: Path) -> None:
    rec = write_lines(tmp_path / "r.jsonl", [
        b'{"topic":"flare.jobs.v1","key":"j","value":{"v":1,"job":"j","event":"start","ts_ns":5}}',
        b'{"topic":"flare.steps.v1","key":"j","value":{"v":1,"t_end_ns":9}}',
        b"",
        b'{"topic":"flare.steps.v1","key":"j","value":"{broken"}',
    ])
    got = list(recording_events(rec))
    assert [(t, k, ts) for t, k, _v, ts in got] == [
        ("flare.jobs.v1", "j", 5), ("flare.steps.v1", "j", 9), ("flare.steps.v1", "j", 9)]
    assert got[2][2] == b"{broken"  # a string value is published verbatim


def test_gzip_recordings_are_read(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b'{"topic":"t","key":"j","value":{"ts_ns":1}}\n')
    assert [m.ts_ns for m in read_recording(path)] == [1]


@pytest.mark.parametrize(("line", "reason"), [
    (b"{nope", "not JSON"),
    (b"[1,2]", "must be a JSON object"),
    (b'{"key":"j","value":{}}', "missing or empty 'topic'"),
    (b'{"topic":"t","key":3,"value":{}}', "'key' must be a string"),
    (b'{"topic":"t","key":"j","value":7}', "'value' must be an object or a string"),
])
def test_bad_recording_lines_say_where_and_why(tmp_path: Path, line: bytes, reason: str) -> None:
    rec = write_lines(tmp_path / "r.jsonl", [b'{"topic":"t","key":"j","value":{}}', line])
    with pytest.raises(RecordingError, match=reason) as info:
        list(read_recording(rec))
    assert info.value.line == 2


def test_written_events_read_back_unchanged(tmp_path: Path) -> None:
    events = [("flare.jobs.v1", "j", {"v": 1, "job": "j", "event": "start", "ts_ns": 5}, 5),
              ("flare.steps.v1", "j", {"v": 1, "step": 0, "t_end_ns": 9}, 9)]
    path = tmp_path / "sub" / "r.jsonl"
    assert write_events(iter(events), path) == 2
    assert list(recording_events(path)) == events
    assert path.read_bytes().splitlines(keepends=True)[1] == recording_line(*events[1][:3])
    assert not list(tmp_path.glob("sub/*.tmp"))  # written aside, then renamed


def test_a_line_is_compact_json_with_a_newline() -> None:
    line = recording_line("t", "j", {"a": [1, 2]})
    assert line == b'{"topic":"t","key":"j","value":{"a":[1,2]}}\n'
