"""Publish a stream of events, optionally paced by their own timestamps.

`flare replay` (a recording) and `flare simulate --bootstrap` (a live simulated cluster) both
end here. Pacing follows the events' `ts_ns` (the training cluster's clock): with `speed=1`
a recording plays in real time, with `speed=10` ten times faster, with `speed=None` as fast
as the broker takes it. The clock and sleep are injectable so pacing is tested with a fake
clock, never with real sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from schemas.clock import SecondsClock

Event = tuple[str, str | bytes, Mapping[str, Any] | bytes, int]
"""(topic, key, value, ts_ns): one message and the cluster time it belongs to."""

MAX_SLEEP_S = 0.25  # sleep in slices so delivery reports are served and Ctrl-C is prompt


class PublisherLike(Protocol):
    def publish(self, topic: str, key: str | bytes, value: Any) -> None: ...

    def poll(self, timeout_s: float = ...) -> None: ...


@dataclass(slots=True)
class PublishedSummary:
    """How many events went out and how far behind schedule the pacing ever fell."""

    events: int = 0
    first_ts_ns: int | None = None
    last_ts_ns: int | None = None
    max_behind_s: float = 0.0


def publish_events(
    events: Iterable[Event],
    publisher: PublisherLike,
    speed: float | None = None,
    *,
    clock: SecondsClock = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    should_stop: Callable[[], bool] = lambda: False,
    poll_every: int = 1000,
) -> PublishedSummary:
    """Publish `events` in order; with `speed`, wait until each one is due.

    The schedule is anchored at the first event: event e is due `(e.ts - first.ts) / speed`
    seconds after we started. Timestamps that go backwards (node clocks disagree by tens of
    ms) are simply due at once; we never reorder. Returns a summary; the caller flushes.
    """
    if speed is not None and speed <= 0:
        raise ValueError(f"speed must be > 0 (or None for as fast as possible), got {speed}")
    summary = PublishedSummary()
    wall0 = clock()
    ts0: int | None = None
    for topic, key, value, ts_ns in events:
        if should_stop():
            break
        if ts0 is None:
            ts0 = ts_ns
            summary.first_ts_ns = ts_ns
        if speed is not None:
            due = wall0 + (ts_ns - ts0) / 1e9 / speed
            while True:
                wait = due - clock()
                if wait <= 0:
                    summary.max_behind_s = max(summary.max_behind_s, -wait)
                    break
                publisher.poll(0)
                sleep(min(wait, MAX_SLEEP_S))
                if should_stop():
                    return summary
        publisher.publish(topic, key, value)
        summary.events += 1
        summary.last_ts_ns = ts_ns
        if summary.events % poll_every == 0:
            publisher.poll(0)
    return summary
