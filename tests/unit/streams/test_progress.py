"""Lag and readiness from our own processed offsets and the fetches' high watermarks."""

from __future__ import annotations

from schemas.testing import FakeClock
from streams.progress import Progress


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


def test_readiness_fails_only_when_input_waits_and_nothing_moves() -> None:
    clock = FakeClock()
    p = Progress(clock.seconds, stall_after_s=30.0)
    assert not p.readiness().ready  # no partitions yet
    p.assigned([("steps", 0)])
    assert p.readiness().ready
    clock.advance(1000.0)
    assert p.readiness().ready  # idle, nothing to read: healthy
    p.set_highwater("steps", 0, 5)
    clock.advance(31.0)
    r = p.readiness()
    assert not r.ready and "5 messages waiting" in r.reason
    p.processed("steps", 0, 4)
    assert p.readiness().ready
    p.stopping = True
    assert not p.readiness().ready
