"""The partial frame's encoding: every field back as it was, and bad bytes refused by name."""

from __future__ import annotations

import struct
from dataclasses import fields, replace
from functools import cache

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus
from schemas import InvalidMessage
from schemas.frame import StepFrame
from schemas.partial_frame import MAGIC, decode_partial, encode_partial


@cache
def _frames() -> list[StepFrame]:
    sc = Scenario(job="p", layout=layout_for_gpus(16), steps=4, seed=1,
                  fault=Fault("slow_gpu", 1.5, 1), heartbeats=False, traced="half")
    return [f for f in ClusterSimulator(sc).run() if isinstance(f, StepFrame)]


def _same(a: StepFrame, b: StepFrame) -> None:
    for f in fields(StepFrame):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert y.dtype == x.dtype and y.flags.writeable, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            assert x == y, f.name


def test_a_simulated_step_comes_back_field_for_field():
    for frame in _frames():
        _same(frame, decode_partial(encode_partial(frame, shard=0, shard_ranks=16)).frame)


def test_wide_values_keep_their_width_and_deltas_restart_at_each_rank():
    f = _frames()[0]
    big = replace(f, op_bytes=f.op_bytes + 2**40, op_dur_ns=f.op_dur_ns * 10**4,
                  op_seq=f.op_seq - 5, t_end_ns=f.t_end_ns + 2**62)
    _same(big, decode_partial(encode_partial(big, shard=0, shard_ranks=16)).frame)


def test_the_encoding_is_smaller_than_the_json_it_replaces():
    frame = _frames()[1]
    raw = encode_partial(frame, shard=0, shard_ranks=16)
    assert len(raw) / frame.n_ops < 40  # JSON takes 57.5 bytes per op (BENCHMARKS.md)


@pytest.mark.parametrize(("mangle", "field"), [
    (lambda raw: raw[:6], "$"),
    (lambda raw: b"XXXX" + raw[4:], "$"),
    (lambda raw: raw[:8] + b"[" + raw[9:], "$.header"),
    (lambda raw: raw[:-1], "$"),
])
def test_damaged_bytes_are_refused_with_the_field(mangle, field):
    raw = encode_partial(_frames()[0], shard=0, shard_ranks=16)
    with pytest.raises(InvalidMessage) as e:
        decode_partial(mangle(raw))
    assert e.value.field == field


def _with_header(raw: bytes, **changes: object) -> bytes:
    n = struct.unpack_from("<I", raw, 4)[0]
    head = msgspec.json.decode(raw[8:8 + n])
    head.update(changes)
    new = msgspec.json.encode(head)
    body = raw[8 + n + (-(8 + n) % 8):]
    return MAGIC + struct.pack("<I", len(new)) + new + b"\0" * (-(8 + len(new)) % 8) + body


@pytest.mark.parametrize(("changes", "field"), [
    ({"v": 2}, "$.header.v"),
    ({"shard_ranks": 0}, "$.header.shard"),
    ({"shard": 1}, "$.rank"),
    ({"names": ["only"]}, "$.op_name"),
    ({"nodes": []}, "$.node"),
])
def test_a_header_that_does_not_fit_its_columns_is_refused(changes, field):
    raw = encode_partial(_frames()[0], shard=0, shard_ranks=16)
    with pytest.raises(InvalidMessage) as e:
        decode_partial(_with_header(raw, **changes))
    assert e.value.field == field


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_damage_is_an_invalid_message_or_a_frame(data):
    raw = bytearray(encode_partial(_frames()[0], shard=0, shard_ranks=16))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        part = decode_partial(bytes(raw[:cut]))
    except InvalidMessage:
        return
    f = part.frame
    assert f.off[-1] == f.n_ops and f.coords.shape == (f.n_ranks, 5)
