"""Lag and readiness from our own processed offsets and the fetches' high watermarks."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import aiokafka
import pytest
from faust.exceptions import ConsumerNotStarted

from schemas.testing import FakeClock
from streams.progress import Progress, Readiness


def test_lag_comes_from_processed_offsets_and_fetch_highwaters() -> None:
    clock = FakeClock()
    p = Progress(clock.seconds, stall_after_s=30.0)
    p.assigned([("steps", 0), ("steps", 1), ("heartbeats", 0)])
    p.set_highwater("steps", 0, 10)
    p.processed("steps", 0, 3)
    assert p.lag(("steps", 0)) == 6
    assert p.lag(("steps", 1)) == 0  # never fetched: nothing known to wait
    p.processed("heartbeats", 0, 7)  # beyond a stale highwater: never negative
    assert p.lag(("heartbeats", 0)) == 0
    assert p.total_lag() == 6
    assert p.caught_up_partitions() == [1]
    p.processed("steps", 0, 9)
    assert p.caught_up_partitions() == [0, 1]


def test_acked_offsets_trail_the_processed_ones_and_leave_with_the_partition() -> None:
    """Processed but not acked: held for order or still being stored (not yet committable)."""
    p = Progress(FakeClock().seconds)
    p.assigned([("steps", 0), ("jobs", 0)])
    for offset in range(4):
        p.processed("jobs", 0, offset)
    p.acked("jobs", 0, 1)
    p.acked("jobs", 0, 0)  # an earlier record acked later (released by the merge)
    snap = p.snapshot()
    assert snap["processed"] == {"jobs[0]": 3} and snap["acked"] == {"jobs[0]": 1}
    p.acked("jobs", 0, 3)
    assert p.snapshot()["acked"] == p.snapshot()["processed"]
    p.assigned([("steps", 0)])  # revoked: its offsets belong to the new owner
    assert p.snapshot()["acked"] == {} and p.snapshot()["processed"] == {}


def test_readiness_fails_when_input_waits_and_nothing_moves() -> None:
    clock = FakeClock()
    p = Progress(clock.seconds, stall_after_s=30.0)
    assert not p.readiness().ready  # no partitions yet
    p.assigned([("steps", 0)])
    assert p.readiness().ready
    for mark in range(1000):  # idle, nothing to read, the broker answering: healthy
        clock.advance(1.0)
        p.fetched("steps", 0, mark)
    assert p.readiness().ready
    p.set_highwater("steps", 0, 5)
    clock.advance(31.0)
    r = p.readiness()
    assert not r.ready and "5 messages waiting" in r.reason
    p.processed("steps", 0, 4)
    assert p.readiness().ready
    p.stopping = True
    assert not p.readiness().ready


def test_a_broker_outage_fails_readiness_and_its_return_restores_it() -> None:
    """No lag is known during an outage: only the silence of the fetches tells."""
    clock = FakeClock()
    p = Progress(clock.seconds, stall_after_s=30.0)
    p.assigned([("steps", 0), ("steps", 1)])
    for mark in range(100, 130):  # healthy and idle: every fetch answered, empty
        clock.advance(1.0)
        p.fetched("steps", 0, mark)
        p.fetched("steps", 1, mark)
        assert p.readiness().ready
    clock.advance(20.0)  # the broker goes away: the marks stop changing
    p.fetched("steps", 0, 129)
    p.fetched("steps", 1, 129)
    assert p.readiness().ready  # not yet stall_after_s
    clock.advance(21.0)
    r = p.readiness()
    assert not r.ready and r.reason.startswith("no answer from the broker for 41 s")
    assert p.total_lag() == 0  # the old rule alone would have said ready
    p.fetched("steps", 1, 200)  # it answers again
    assert p.readiness() == Readiness(True, "ok")


def test_a_worker_draining_its_buffer_is_not_in_an_outage() -> None:
    """A busy worker sends no fetch for partitions it still has records of."""
    clock = FakeClock()
    p = Progress(clock.seconds, stall_after_s=30.0)
    p.assigned([("steps", 0)])
    p.set_highwater("steps", 0, 10_000)
    p.fetched("steps", 0, 1)
    for offset in range(120):  # two minutes of processing, no fetch answered
        clock.advance(1.0)
        p.processed("steps", 0, offset)
        assert p.readiness().ready


def test_a_repeated_mark_or_none_is_no_answer() -> None:
    clock = FakeClock()
    p = Progress(clock.seconds, stall_after_s=5.0)
    p.assigned([("steps", 0)])
    p.fetched("steps", 0, 7)
    clock.advance(6.0)
    p.fetched("steps", 0, 7)  # the same response as before
    p.fetched("steps", 0, None)  # a partition not fetched since the assignment
    assert not p.readiness().ready
    assert p.snapshot()["seconds_since_broker_answer"] == 6.0


def test_a_rebalance_restarts_the_broker_clock_and_drops_gone_partitions() -> None:
    clock = FakeClock()
    p = Progress(clock.seconds, stall_after_s=5.0)
    p.assigned([("steps", 0), ("steps", 1)])
    p.fetched("steps", 1, 3)
    clock.advance(6.0)
    assert not p.readiness().ready
    p.assigned([("steps", 0)])  # the coordinator answered the rejoin
    assert p.readiness().ready
    p.assigned([("steps", 0), ("steps", 1)])
    p.fetched("steps", 1, 3)  # the mark it had before leaving is news after coming back
    clock.advance(4.0)
    assert p.readiness().ready and p.seconds_since_answer() == 4.0


def test_a_worker_with_no_partitions_is_not_failed_by_silence() -> None:
    """More workers than partitions: a standby fetches nothing, and is healthy."""
    clock = FakeClock()
    p = Progress(clock.seconds, stall_after_s=30.0)
    p.assigned([])
    clock.advance(1000.0)
    assert p.readiness().ready


def test_a_stall_during_an_outage_names_both() -> None:
    clock = FakeClock()
    p = Progress(clock.seconds, stall_after_s=30.0)
    p.assigned([("steps", 0)])
    p.set_highwater("steps", 0, 5)
    clock.advance(31.0)
    r = p.readiness()
    assert not r.ready
    assert "stalled: 5 messages waiting" in r.reason
    assert "no answer from the broker for 31 s" in r.reason
    p.fetched("steps", 0, 1)  # the broker answers; the stall stays
    r = p.readiness()
    assert not r.ready and "no answer" not in r.reason and "stalled" in r.reason


def test_the_worker_can_read_the_fetch_marks_it_relies_on(
        worker_app: Callable[..., Any]) -> None:
    """`streams/worker.py` reads aiokafka's per-partition fetch time through faust's
    consumer thread; fail here, not silently in production, if either renames it."""
    app = worker_app()
    thread = app.consumer._thread
    with pytest.raises(ConsumerNotStarted):  # what sample_highwaters guards against
        thread._ensure_consumer()
    assert callable(aiokafka.AIOKafkaConsumer.last_poll_timestamp)
    source = inspect.getsource(aiokafka.consumer.fetcher.Fetcher._proc_fetch_request)
    assert "tp_state.timestamp = now_ms" in source  # set on every answered fetch, empty too
    assert "return assignment.state_value(partition).timestamp" in inspect.getsource(
        aiokafka.AIOKafkaConsumer.last_poll_timestamp)
