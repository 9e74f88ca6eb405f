"""Publishing a stream of events paced by their own timestamps, on the fake clock."""

from __future__ import annotations

from typing import Any

import pytest

from producers.live import publish_events
from schemas.clock import NS_PER_S
from schemas.testing import FakeClock


def start_clock() -> FakeClock:
    return FakeClock(start_ns=100 * NS_PER_S)


class ListPublisher:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sent: list[tuple[float, str]] = []

    def publish(self, topic: str, key: str | bytes, value: Any) -> None:
        self.sent.append((self.clock.seconds(), value["n"]))

    def poll(self, timeout_s: float = 0.0) -> None:
        pass


def events(ts_s: list[float]) -> list[tuple[str, str, dict[str, Any], int]]:
    return [("t", "j", {"n": f"e{i}"}, int(1_000 * 10**9 + t * 1e9)) for i, t in enumerate(ts_s)]


def test_pacing_follows_event_time_scaled_by_speed() -> None:
    clock = start_clock()
    pub = ListPublisher(clock)
    summary = publish_events(events([0.0, 1.0, 1.0, 3.0]), pub, speed=2.0,
                             clock=clock.seconds, sleep=clock.sleep)
    assert summary.events == 4
    assert [round(t - 100.0, 6) for t, _ in pub.sent] == [0.0, 0.5, 0.5, 1.5]
    assert [n for _, n in pub.sent] == ["e0", "e1", "e2", "e3"]


def test_no_speed_means_no_sleeping_and_backwards_time_is_not_reordered() -> None:
    clock = start_clock()
    pub = ListPublisher(clock)
    publish_events(events([5.0, 0.0, 9.0]), pub, None, clock=clock.seconds, sleep=clock.sleep)
    assert clock.sleeps == []
    assert [n for _, n in pub.sent] == ["e0", "e1", "e2"]
    publish_events(events([5.0, 4.9, 5.5]), pub, 1.0, clock=clock.seconds, sleep=clock.sleep)
    assert [n for _, n in pub.sent][-3:] == ["e0", "e1", "e2"]


def test_stop_request_ends_publishing() -> None:
    clock = start_clock()
    pub = ListPublisher(clock)
    summary = publish_events(events([0, 1, 2, 3]), pub, 1.0, clock=clock.seconds,
                             sleep=clock.sleep, should_stop=lambda: len(pub.sent) >= 2)
    assert summary.events == 2


def test_bad_speed_is_refused() -> None:
    with pytest.raises(ValueError, match="speed must be > 0"):
        publish_events([], ListPublisher(start_clock()), 0.0)
