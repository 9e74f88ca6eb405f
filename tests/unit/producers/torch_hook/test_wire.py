"""The hook-to-agent framing: round trip and the limits a peer cannot pass."""

from __future__ import annotations

import pytest

from producers.torch_hook.wire import (
    MAX_FRAME_BYTES,
    STEPS,
    FrameError,
    decode_header,
    encode_frame,
)


def test_frame_header_round_trip_and_limits():
    raw = encode_frame(STEPS, b"abc")
    assert decode_header(raw[:5]) == (3, STEPS) and raw[5:] == b"abc"
    with pytest.raises(FrameError):
        decode_header(b"\x00\x00\x00\x01\x09")  # unknown type
    with pytest.raises(FrameError):
        decode_header(b"\xff\xff\xff\xff\x02")  # longer than any frame may be


def test_unknown_types_and_oversized_payloads_are_not_sent():
    with pytest.raises(FrameError, match="unknown frame type"):
        encode_frame(9, b"")
    with pytest.raises(FrameError, match="exceeds"):
        encode_frame(STEPS, b"x" * (MAX_FRAME_BYTES + 1))
