"""The one error type for bad input: it says which field was wrong and why."""

from __future__ import annotations


class InvalidMessage(ValueError):
    """A message that does not follow wire contract v1.

    `field` is a JSON path such as ``$.ops.dur_ns[3]`` (or ``$`` for the whole message) and
    `reason` a sentence; both end up in the dead-letter record so an operator can fix the
    producer without reading worker logs.
    """

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")
