"""Event-time merge of a job's three input topics before they reach its diagnoser.

Kafka orders messages within a topic-partition only. A job's steps, heartbeats and job
events sit on three topics, and a consumer that is behind (a replay, a restart, a lagging
worker) receives them interleaved however the fetcher round-robins: a job's `end` event or
its heartbeats from a minute later can arrive before the steps they follow. Heartbeats
advance the diagnoser's clock, so such an order expires grace periods early (steps
assembled with "missing" ranks) and an early `end` flushes the job mid-stream: the worker
would diagnose a different stream than `flare diagnose` reads from the recording.

So, like Kafka Streams' record buffers, each job keeps one queue per topic and releases the
head with the smallest event time, but only while every queue that is empty is empty for
good, i.e. its topic-partition has nothing left to fetch (no lag); otherwise it waits for
that topic to catch up. Waiting is bounded in time (`max_hold_s`) and space
(`max_buffered`), so a stalled topic delays a job a little but never blocks it. In real time
there is no lag and nothing waits.

Within a topic the order is never changed (offset order), so this is a merge, not a sort.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class _Held(Generic[T]):
    time_ns: int
    rank: int  # tie-break between topics at equal event times
    since: float  # worker clock when it was buffered
    item: T


class EventTimeMerger(Generic[T]):
    """Per-job queues per topic, released in event-time order when safe."""

    def __init__(
        self,
        topics: tuple[str, ...],
        now: Callable[[], float],
        *,
        max_hold_s: float = 5.0,
        max_buffered: int = 200_000,
    ) -> None:
        self.topics = topics
        self._rank = {t: i for i, t in enumerate(topics)}
        self._now = now
        self.max_hold_s = max_hold_s
        self.max_buffered = max_buffered
        self._jobs: dict[tuple[int, str], dict[str, deque[_Held[T]]]] = {}
        self.buffered = 0
        self.forced = 0  # releases made before it was safe (hold time or space exceeded)

    def push(self, partition: int, job: str, topic: str, time_ns: int, item: T) -> None:
        queues = self._jobs.get((partition, job))
        if queues is None:
            queues = self._jobs[(partition, job)] = {t: deque() for t in self.topics}
        queues[topic].append(_Held(time_ns, self._rank[topic], self._now(), item))
        self.buffered += 1

    def partitions_with_items(self) -> set[int]:
        return {p for p, _j in self._jobs}

    def release(self, has_more: Callable[[str, int], bool]) -> list[T]:
        """Items that may go to their diagnosers now, in a valid per-job order.

        `has_more(topic, partition)`: whether that topic-partition still has messages we have
        not received (lag > 0); an empty queue of such a topic makes its job wait.
        """
        out: list[T] = []
        now = self._now()
        for key in list(self._jobs):
            partition, _job = key
            queues = self._jobs[key]
            waiting_on = [t for t, q in queues.items() if not q and has_more(t, partition)]
            while True:
                heads = [q[0] for q in queues.values() if q]
                if not heads:
                    del self._jobs[key]
                    break
                if waiting_on:
                    oldest = min(h.since for h in heads)
                    if now - oldest < self.max_hold_s and self.buffered <= self.max_buffered:
                        break
                    self.forced += 1
                best = min(heads, key=lambda h: (h.time_ns, h.rank))
                queue = queues[self.topics[best.rank]]
                queue.popleft()
                self.buffered -= 1
                out.append(best.item)
                if not queue and has_more(self.topics[best.rank], partition):
                    waiting_on.append(self.topics[best.rank])
        return out

    def drop(self, partitions: set[int]) -> list[T]:
        """Forget the buffered items of revoked partitions (their new owner re-reads them)."""
        dropped: list[T] = []
        for key in [k for k in self._jobs if k[0] in partitions]:
            for q in self._jobs.pop(key).values():
                dropped.extend(h.item for h in q)
        self.buffered -= len(dropped)
        return dropped
