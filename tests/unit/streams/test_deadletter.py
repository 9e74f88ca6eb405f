"""Dead letters: the original bytes for whoever fixes the producer, within bounds."""

from __future__ import annotations

import base64

from schemas.topics import STEPS
from streams.deadletter import cause_of, make_dead_letter


def test_a_dead_letter_carries_the_payload_but_never_an_oversized_one() -> None:
    small = make_dead_letter(STEPS, 1, 2, "$.v: bad", b"abc")
    assert base64.b64decode(small.payload_b64) == b"abc" and small.reason == "$.v: bad"
    big = make_dead_letter(STEPS, 1, 2, "$: too big", b"x" * 100, max_payload_bytes=10)
    assert base64.b64decode(big.payload_b64) == b"x" * 10
    assert "cut to its first 10 of 100 bytes" in big.reason
    assert "flare.steps.v1[1]@2" in big.reason  # where the original still is


def test_causes_do_not_explode_into_one_label_per_index() -> None:
    assert cause_of("$.ops.dur_ns[3]") == cause_of("$.ops.dur_ns[71]") == "$.ops.dur_ns"
