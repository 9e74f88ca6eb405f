"""The producer side without a broker: configuration, encoding, pacing, recordings."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson
import pytest

from producers.live import publish_events
from producers.publisher import Publisher, PublishError, producer_config
from producers.recording import RecordingError, read_recording, recording_events


class FakeProducer:
    """Stands in for confluent_kafka.Producer: same three methods, records what it got."""

    def __init__(self, conf: dict[str, Any], *, full_times: int = 0,
                 fail: set[int] | None = None) -> None:
        self.conf = conf
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.pending: list[Any] = []
        self.polls = 0
        self.closed = False
        self._full = full_times
        self._fail = fail or set()

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                on_delivery: Any = None) -> None:
        if self._full:
            self._full -= 1
            raise BufferError("queue full")
        assert value is not None and key is not None
        self.sent.append((topic, key, value))
        self.pending.append((len(self.sent) - 1, on_delivery))

    def _deliver(self) -> None:
        for i, cb in self.pending:
            cb("broker said no" if i in self._fail else None, None)
        self.pending.clear()

    def poll(self, timeout: float = 0.0) -> int:
        self.polls += 1
        self._deliver()
        return 0

    def flush(self, timeout: float = 0.0) -> int:
        self._deliver()
        return 0

    def close(self) -> bool:
        self.closed = True
        return True


def make(**kw: Any) -> tuple[Publisher, FakeProducer]:
    holder: list[FakeProducer] = []

    def factory(conf: dict[str, Any]) -> FakeProducer:
        holder.append(FakeProducer(conf, **kw))
        return holder[0]

    return Publisher("127.0.0.1:1", producer_factory=factory), holder[0]


def test_config_is_idempotent_murmur2_batched_and_compressed() -> None:
    conf = producer_config("k:9092")
    assert conf["compression.type"] == "lz4"  # the worker's aiokafka reads it via cramjam
    assert conf["enable.idempotence"] is True
    assert conf["partitioner"] == "murmur2_random"
    assert conf["linger.ms"] > 0 and conf["batch.size"] >= 64 * 1024
    assert producer_config("k:9092", extra={"linger.ms": 0})["linger.ms"] == 0


def test_publish_keys_by_job_and_encodes_dicts() -> None:
    pub, fake = make()
    pub.publish("flare.steps.v1", "job-1", {"v": 1, "job": "job-1"})
    pub.publish("flare.steps.v1", b"job-2", b'{"raw":true}')
    stats = pub.flush()
    assert [(t, k) for t, k, _ in fake.sent] == [("flare.steps.v1", b"job-1"),
                                                ("flare.steps.v1", b"job-2")]
    assert orjson.loads(fake.sent[0][2]) == {"v": 1, "job": "job-1"}
    assert fake.sent[1][2] == b'{"raw":true}'
    assert stats.delivered == 2 and stats.failed == 0


def test_leaving_the_context_flushes_then_closes() -> None:
    pub, fake = make()
    with pub:
        pub.publish("t", "j", b"x")
    assert pub.stats.delivered == 1 and fake.closed


def test_a_full_queue_blocks_instead_of_dropping() -> None:
    pub, fake = make(full_times=3)
    pub.publish("t", "j", b"x")
    assert len(fake.sent) == 1
    assert fake.polls >= 3


def test_failed_deliveries_surface_at_flush() -> None:
    pub, _fake = make(fail={1})
    for i in range(3):
        pub.publish("t", "j", {"i": i})
    with pytest.raises(PublishError, match="1 of 3 messages were not delivered.*broker said no"):
        pub.flush()


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


class ListPublisher:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sent: list[tuple[float, str]] = []

    def publish(self, topic: str, key: str | bytes, value: Any) -> None:
        self.sent.append((self.clock.t, value["n"]))

    def poll(self, timeout_s: float = 0.0) -> None:
        pass


def events(ts_s: list[float]) -> list[tuple[str, str, dict[str, Any], int]]:
    return [("t", "j", {"n": f"e{i}"}, int(1_000 * 10**9 + t * 1e9)) for i, t in enumerate(ts_s)]


def test_pacing_follows_event_time_scaled_by_speed() -> None:
    clock = FakeClock()
    pub = ListPublisher(clock)
    summary = publish_events(events([0.0, 1.0, 1.0, 3.0]), pub, speed=2.0,
                             clock=clock.now, sleep=clock.sleep)
    assert summary.events == 4
    assert [round(t - 100.0, 6) for t, _ in pub.sent] == [0.0, 0.5, 0.5, 1.5]
    assert [n for _, n in pub.sent] == ["e0", "e1", "e2", "e3"]


def test_no_speed_means_no_sleeping_and_backwards_time_is_not_reordered() -> None:
    clock = FakeClock()
    pub = ListPublisher(clock)
    publish_events(events([5.0, 0.0, 9.0]), pub, None, clock=clock.now, sleep=clock.sleep)
    assert clock.sleeps == []
    assert [n for _, n in pub.sent] == ["e0", "e1", "e2"]
    publish_events(events([5.0, 4.9, 5.5]), pub, 1.0, clock=clock.now, sleep=clock.sleep)
    assert [n for _, n in pub.sent][-3:] == ["e0", "e1", "e2"]


def test_stop_request_ends_publishing() -> None:
    clock = FakeClock()
    pub = ListPublisher(clock)
    summary = publish_events(events([0, 1, 2, 3]), pub, 1.0, clock=clock.now,
                             sleep=clock.sleep, should_stop=lambda: len(pub.sent) >= 2)
    assert summary.events == 2


def test_bad_speed_is_refused() -> None:
    with pytest.raises(ValueError, match="speed must be > 0"):
        publish_events([], ListPublisher(FakeClock()), 0.0)


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
