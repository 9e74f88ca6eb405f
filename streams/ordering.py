"""Event-time merge of a job's steps and job events before they reach its diagnoser.

Kafka orders messages within a topic-partition only. A job's steps and job events sit on two
topics, and a consumer that is behind (a replay, a restart, a lagging worker) receives them
interleaved however the fetcher round-robins: a job's `end` event can arrive before the
steps it follows, and an early `end` flushes the job mid-stream (steps assembled with
"missing" ranks): the worker would diagnose a different stream than `flare diagnose` reads
from the recording.

Heartbeats are not merged (the pipeline dispatches them as they come): they feed only the
hang detector, never step assembly, so their order against steps changes no step; and they
are most of the messages, so holding them behind a lagging steps topic filled this buffer
(200,000 held at 8,192 GPUs) and cost a push and a release each.

So, like Kafka Streams' record buffers, each job keeps one queue per topic and releases the
head with the smallest event time, but only while every queue that is empty is empty for
good, i.e. its topic-partition has nothing left to fetch (no lag); otherwise it waits for
that topic to catch up. Waiting is bounded in time (`max_hold_s`) and space
(`max_buffered`), so a stalled topic delays a job a little but never blocks it. In real time
there is no lag and nothing waits.

The hold is timed per (job, topic) from the moment that topic's queue is empty while its
partition still has messages to fetch, not from the age of what is held: under a backlog a
job's `end` event sits in its queue for as long as the job's steps take to drain, and each
refill of the steps queue proves the topic is flowing, not stalled. Timing from the oldest
held item would force the `end` out ahead of the steps it must follow.

Within a topic the order is never changed (offset order), so this is a merge, not a sort.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from schemas.clock import SecondsClock

T = TypeVar("T")


@dataclass(slots=True)
class _Held(Generic[T]):
    time_ns: int
    rank: int  # tie-break between topics at equal event times
    item: T


@dataclass(slots=True)
class _Queues(Generic[T]):
    """One job's queue per topic, and since when each empty one has been waited on."""

    queues: dict[str, deque[_Held[T]]]
    waiting_since: dict[str, float] = field(default_factory=dict)


class EventTimeMerger(Generic[T]):
    """Per-job queues per topic, released in event-time order when safe."""

    def __init__(
        self,
        topics: tuple[str, ...],
        now: SecondsClock,
        *,
        max_hold_s: float = 5.0,
        max_buffered: int = 200_000,
    ) -> None:
        self.topics = topics
        self._rank = {t: i for i, t in enumerate(topics)}
        self._now = now
        self.max_hold_s = max_hold_s
        self.max_buffered = max_buffered
        self._jobs: dict[tuple[int, str], _Queues[T]] = {}
        self.buffered = 0
        self.forced = 0  # releases made before it was safe (hold time or space exceeded)
        self.forced_by_topic: dict[str, int] = {}  # ... per topic that was waited on

    def push(self, partition: int, job: str, topic: str, time_ns: int, item: T) -> None:
        job_queues = self._jobs.get((partition, job))
        if job_queues is None:
            job_queues = self._jobs[(partition, job)] = _Queues({t: deque() for t in self.topics})
        job_queues.queues[topic].append(_Held(time_ns, self._rank[topic], item))
        job_queues.waiting_since.pop(topic, None)
        self.buffered += 1

    def partitions_with_items(self) -> set[int]:
        return {p for (p, _j), job in self._jobs.items() if any(job.queues.values())}

    def release(self, has_more: Callable[[str, int], bool], limit: int | None = None) -> list[T]:
        """Items that may go to their diagnosers now, in a valid per-job order.

        `has_more(topic, partition)`: whether that topic-partition still has messages we have
        not received (lag > 0); an empty queue of such a topic makes its job wait. `limit`:
        at most that many, the rest staying in order for the next call. A lagging topic that
        catches up frees everything held behind it at once (8,600 messages of a thousand
        jobs in one churn run), and the caller diagnoses what it is given in one go.
        """
        out: list[T] = []
        now = self._now()
        room = self.buffered if limit is None else limit
        for key in list(self._jobs):
            if len(out) >= room:
                break
            partition, _job = key
            job_queues = self._jobs[key]
            queues, since = job_queues.queues, job_queues.waiting_since
            for t, q in queues.items():
                if q or not has_more(t, partition):
                    since.pop(t, None)
                else:
                    since.setdefault(t, now)
            while True:
                heads = [q[0] for q in queues.values() if q]
                if not heads:
                    del self._jobs[key]
                    break
                if len(out) >= room:
                    break
                if since:
                    waited = now - max(since.values())
                    if waited < self.max_hold_s and self.buffered <= self.max_buffered:
                        break
                    self.forced += 1
                    for t in since:
                        self.forced_by_topic[t] = self.forced_by_topic.get(t, 0) + 1
                best = min(heads, key=lambda h: (h.time_ns, h.rank))
                topic = self.topics[best.rank]
                queue = queues[topic]
                queue.popleft()
                self.buffered -= 1
                out.append(best.item)
                if not queue and has_more(topic, partition):
                    since[topic] = now
        return out

    def drop(self, partitions: set[int]) -> list[T]:
        """Forget the buffered items of revoked partitions (their new owner re-reads them)."""
        dropped: list[T] = []
        for key in [k for k in self._jobs if k[0] in partitions]:
            for q in self._jobs.pop(key).queues.values():
                dropped.extend(h.item for h in q)
        self.buffered -= len(dropped)
        return dropped
