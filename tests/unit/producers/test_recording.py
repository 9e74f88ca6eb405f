"""Recorded streams: every line read back as an event, bad lines named, the writer's lines."""

from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pytest

from producers.publisher import TeePublisher
from producers.recording import (
    RecordingError,
    RecordingPublisher,
    read_recording,
    recording_events,
    recording_line,
    write_events,
)
from producers.testing import MemoryPublisher


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


def test_a_recording_publisher_keeps_a_copy_that_reads_back_as_sent(tmp_path: Path) -> None:
    """`flare agent --record`: the tee's copy is a recording of exactly what Kafka got."""
    kafka = MemoryPublisher()
    path = tmp_path / "node-0.jsonl"
    with open(path, "wb") as f:
        tee = TeePublisher(kafka, RecordingPublisher(f))
        tee.publish("flare.steps.v1", "job-a", {"step": 3, "t_end_ns": 5})
        tee.publish("flare.heartbeats.v1", b"job-a", b'{"ts_ns": 7}')
        assert path.read_bytes().count(b"\n") == 2  # each line is out before the next call
        tee.flush()
    back = [(m.topic, m.key, m.value) for m in read_recording(path)]
    assert back == [("flare.steps.v1", "job-a", {"step": 3, "t_end_ns": 5}),
                    ("flare.heartbeats.v1", "job-a", {"ts_ns": 7})]
    assert [(t, k, orjson.loads(v)) for t, k, v in kafka.messages] == [
        ("flare.steps.v1", b"job-a", {"step": 3, "t_end_ns": 5}),
        ("flare.heartbeats.v1", b"job-a", {"ts_ns": 7})]
    assert kafka.flushes == 1
