"""The producers' fake publisher: messages kept in memory, for tests and benchmarks.

It ships with the code (not in a test module) because the agent's tests, the torch tests and
the hook benchmark all need the same one, and a fake next to the real `KafkaPublisher` is
kept in step with the `Publisher` protocol by the type checker.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import orjson

from producers.publisher import Message


class MemoryPublisher:
    """A `Publisher` that appends every message to `messages` and the partition it was
    given (None: its key's) to `partitions` (thread-safe)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.partitions: list[int | None] = []
        self.flushes = 0
        self._lock = threading.Lock()

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any],
                partition: int | None = None) -> None:
        k = key if isinstance(key, bytes) else key.encode()
        v = value if isinstance(value, bytes) else orjson.dumps(value)
        with self._lock:
            self.messages.append((topic, k, v))
            self.partitions.append(partition)

    def flush(self, timeout_s: float = 30.0) -> None:
        self.flushes += 1

    def on(self, topic: str) -> list[dict[str, Any]]:
        """Decoded values published on `topic`, in order."""
        with self._lock:
            return [orjson.loads(v) for t, _k, v in self.messages if t == topic]
