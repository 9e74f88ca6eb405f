"""The agent's bounded queue to the publisher, drained by one thread.

The publisher may block (its own queue full, broker away); the agent's event loop must not,
or ranks' frames back up into their sockets and the hook starts dropping steps. So the loop
only puts messages here; when this queue is full new messages are dropped and counted, and
memory stays bounded. Batching and reconnection are the Kafka client's job, not ours.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

from producers.publisher import Message, Publisher

log = logging.getLogger("flare.agent")


@dataclass(slots=True)
class OutboxStats:
    published: int = 0
    dropped: int = 0
    publish_errors: int = 0
    flush_errors: int = 0


class Outbox:
    """`put` from the event loop, `start` the draining thread, `close` to publish and flush."""

    def __init__(self, publisher: Publisher, *, max_messages: int = 100_000,
                 flush_every_s: float = 1.0, flush_timeout_s: float = 10.0) -> None:
        self.publisher = publisher
        self.flush_every_s = flush_every_s
        self.flush_timeout_s = flush_timeout_s
        self.stats = OutboxStats()
        self._q: queue.Queue[Message | None] = queue.Queue(max_messages)
        self._thread = threading.Thread(target=self._run, name="flare-agent-outbox", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, messages: list[Message]) -> None:
        for m in messages:
            try:
                self._q.put_nowait(m)
            except queue.Full:
                self.stats.dropped += 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Publish what is queued, flush, stop."""
        with contextlib.suppress(queue.Full):
            self._q.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)

    def _flush(self) -> None:
        try:
            self.publisher.flush(self.flush_timeout_s)
        except Exception as exc:
            self.stats.flush_errors += 1
            log.warning("flush failed: %s", exc)

    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_every_s
        while True:
            try:
                item = self._q.get(timeout=max(0.0, next_flush - time.monotonic()))
            except queue.Empty:
                item = ()  # type: ignore[assignment]
            if item is None:
                self._flush()
                return
            if item:
                topic, key, value = item
                try:
                    self.publisher.publish(topic, key, value)
                    self.stats.published += 1
                except Exception as exc:
                    self.stats.publish_errors += 1
                    log.warning("publish failed: %s", exc)
            if time.monotonic() >= next_flush:
                self._flush()
                next_flush = time.monotonic() + self.flush_every_s
