"""Recorded streams (`.jsonl`, DESIGN §3), one Kafka message per line: the one reader and writer.

The simulator, `flare replay --kineto --out` and `flare agent --dry-run` write them, `flare
replay` and `flare diagnose` read them; keeping both directions here keeps the line format in
one place. Each line is `{"topic": ..., "key": "<job>", "value": {...}}`. A `value` that is a JSON
string is published verbatim as its UTF-8 bytes, so a recording can carry deliberately
malformed payloads (dead-letter tests, bug reports). Files ending in `.gz` are read through
gzip. The cluster time of each message (for paced replay) is its `ts_ns`, or `t_end_ns` for
a rank-step (the moment the rank would have sent it).
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import orjson


class RecordingError(ValueError):
    """A line of a recording is not a `{"topic", "key", "value"}` object."""

    def __init__(self, path: Path, line: int, reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        super().__init__(f"{path}:{line}: {reason}")


@dataclass(frozen=True, slots=True)
class RecordedMessage:
    topic: str
    key: str
    value: Mapping[str, Any] | bytes
    ts_ns: int

    def as_event(self) -> tuple[str, str, Mapping[str, Any] | bytes, int]:
        return (self.topic, self.key, self.value, self.ts_ns)


def message_ts_ns(value: Mapping[str, Any] | bytes, default: int) -> int:
    """Cluster time of one message: ts_ns (heartbeats, job events) or t_end_ns (steps)."""
    if isinstance(value, Mapping):
        for field in ("ts_ns", "t_end_ns"):
            ts = value.get(field)
            if isinstance(ts, int) and not isinstance(ts, bool):
                return ts
    return default


def _open(path: Path) -> IO[bytes]:
    if path.suffix == ".gz":
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb")  # noqa: SIM115


def read_recording(path: str | Path) -> Iterator[RecordedMessage]:
    """Yield the messages of a recording in file order; RecordingError on a bad line.

    Messages without a timestamp inherit the previous one, so pacing never jumps back to 0.
    """
    p = Path(path)
    last_ts = 0
    with _open(p) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise RecordingError(p, lineno, f"not JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise RecordingError(p, lineno, "a line must be a JSON object")
            topic, key, value = obj.get("topic"), obj.get("key"), obj.get("value")
            if not isinstance(topic, str) or not topic:
                raise RecordingError(p, lineno, "missing or empty 'topic'")
            if not isinstance(key, str):
                raise RecordingError(p, lineno, "'key' must be a string (the job id)")
            if isinstance(value, str):
                payload: Mapping[str, Any] | bytes = value.encode("utf-8")
            elif isinstance(value, dict):
                payload = value
            else:
                raise RecordingError(p, lineno, "'value' must be an object or a string")
            last_ts = message_ts_ns(payload, last_ts)
            yield RecordedMessage(topic, key, payload, last_ts)


def recording_events(path: str | Path) -> Iterator[tuple[str, str, Mapping[str, Any] | bytes, int]]:
    """The recording as `(topic, key, value, ts_ns)` events for `publish_events`."""
    for m in read_recording(path):
        yield m.as_event()


def recording_line(topic: str, key: str, value: Mapping[str, Any]) -> bytes:
    """One line of a recording, newline included."""
    return orjson.dumps({"topic": topic, "key": key, "value": value}) + b"\n"


class RecordingPublisher:
    """A `Publisher` that writes each message as a recording line to a binary stream.

    The agent's dry run writes to stdout; with `--record` it writes next to its Kafka
    publishing, so a node keeps its own copy of what it sent (the drill counts from it what
    the broker lost). Every line is flushed at once: a reader following the file sees whole
    messages, and a killed agent loses at most the line it was writing.
    """

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any]) -> None:
        k = key.decode() if isinstance(key, bytes) else key
        v = orjson.loads(value) if isinstance(value, bytes) else value
        line = recording_line(topic, k, v)
        with self._lock:
            self.stream.write(line)
            self.stream.flush()

    def flush(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            self.stream.flush()


def write_events(events: Iterable[tuple[str, str, Any, int]], path: str | Path) -> int:
    """Write `(topic, key, value, ts_ns)` events as a recorded stream; returns the count.

    Written to a temporary name and renamed, so an interrupted run leaves no half file.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    n = 0
    with open(tmp, "wb", buffering=1 << 20) as fh:
        for topic, key, value, _ts in events:
            fh.write(recording_line(topic, key, value))
            n += 1
    tmp.replace(p)
    return n
