"""Dead letters: every input the worker cannot use, kept with the reason and counted.

A bad message must neither crash the worker nor vanish: it becomes a `DeadLetterV1` on
`flare.deadletter.v1` (and in ClickHouse) with its Kafka coordinates, a reason an operator
can act on and the original bytes. Counters are grouped by topic and by a low-cardinality
cause (the JSON path of the bad field with indexes removed), so a dashboard shows *which*
producer bug is happening without one series per array index.
"""

from __future__ import annotations

import base64
import re
from collections import Counter
from dataclasses import dataclass, field

from schemas import InvalidMessage
from schemas.wire import DeadLetterV1

MAX_PAYLOAD_BYTES = 256 * 1024
INTERNAL = "internal"  # the message decoded but the diagnoser raised: a Flare bug, not input
_INDEX = re.compile(r"\[\d+\]")


def cause_of(field_path: str) -> str:
    """`$.ops.dur_ns[3]` -> `$.ops.dur_ns`: a counter label that does not explode."""
    return _INDEX.sub("", field_path)


def make_dead_letter(
    topic: str,
    partition: int,
    offset: int,
    reason: str,
    payload: bytes | None,
    max_payload_bytes: int = MAX_PAYLOAD_BYTES,
) -> DeadLetterV1:
    """The dead letter of one input. An oversized payload is cut to `max_payload_bytes`
    (the reason says so): the original stays at its topic, partition and offset, while a
    dead letter bigger than the broker's message limit would itself be lost."""
    data = payload or b""
    if len(data) > max_payload_bytes:
        reason = (f"{reason} [payload cut to its first {max_payload_bytes} of {len(data)} "
                  f"bytes; the original is at {topic}[{partition}]@{offset}]")
        data = data[:max_payload_bytes]
    return DeadLetterV1(
        v=1,
        topic=topic,
        partition=partition,
        offset=offset,
        reason=reason,
        payload_b64=base64.b64encode(data).decode("ascii"),
    )


def invalid_reason(exc: InvalidMessage) -> str:
    """The reason stored with a dead letter: the field path and what is wrong with it."""
    return f"{exc.field}: {exc.reason}"


@dataclass(slots=True)
class DeadLetterCounts:
    """How many inputs were dead-lettered, by topic and by cause."""

    total: int = 0
    by_topic: Counter[str] = field(default_factory=Counter)
    by_cause: Counter[str] = field(default_factory=Counter)

    def add(self, topic: str, cause: str) -> None:
        self.total += 1
        self.by_topic[topic] += 1
        self.by_cause[cause] += 1

    def as_dict(self) -> dict[str, object]:
        return {
            "total": self.total,
            "by_topic": dict(self.by_topic),
            "by_cause": dict(self.by_cause),
        }
