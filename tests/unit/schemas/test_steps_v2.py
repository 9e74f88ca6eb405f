"""`flare.steps.v2`: a rank's step comes back as v1 decodes it, and bad bytes are refused by
name, never with another exception."""

from __future__ import annotations

import struct
from dataclasses import fields
from functools import cache
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus
from schemas import InvalidMessage
from schemas.decode import decode_steps
from schemas.rankstep import RankStep
from schemas.steps_v2 import (
    HEAD,
    MAGIC,
    decode_steps_v2,
    encode_rank_step,
    encode_steps_v2,
    encode_steps_value,
    restamp,
)
from schemas.topics import STEPS


@cache
def _values() -> list[dict[str, Any]]:
    """Step messages of a simulated job: three kinds, pipeline sends, GC stalls, coords."""
    sc = Scenario(job="v2", layout=layout_for_gpus(16), steps=3, seed=2,
                  fault=Fault("slow_gpu", 1.5, 1), heartbeats=False)
    return [v for t, _k, v, _ts in ClusterSimulator(sc).events() if t == STEPS]


def _same(a: RankStep, b: RankStep) -> None:
    for f in fields(RankStep):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert y.dtype == x.dtype, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        elif f.name in ("name", "group"):
            assert list(x) == list(y), f.name
        else:
            assert x == y, f.name


def test_every_simulated_step_decodes_as_its_v1_message_does():
    for value in _values():
        _same(decode_steps(orjson.dumps(value)), decode_steps_v2(encode_steps_value(value)))


def test_a_decoded_step_encodes_back_to_the_same_bytes():
    for value in _values()[:8]:
        raw = encode_steps_value(value)
        assert encode_rank_step(decode_steps_v2(raw)) == raw


def test_wide_values_gpu_timing_and_an_empty_step_come_back():
    raw = encode_steps_v2(job="j", rank=2**20 - 1, node="n", step=2**40, t_start_ns=-5,
                          t_end_ns=2**62, kind=["coll", "p2p"], name=["a", "b"],
                          group=["dp.0", "pp.0-1"], seq=[2**40, 0], start_ns=[2**50, 3],
                          dur_ns=[2**33, 0], bytes=[2**45, 1], issue_ns=[-1, 7])
    m = decode_steps_v2(raw)
    assert (m.rank, m.step, m.t_start_ns, m.t_end_ns) == (2**20 - 1, 2**40, -5, 2**62)
    assert m.start_ns.tolist() == [2**50, 3] and m.seq.tolist() == [2**40, 0]
    assert m.bytes.tolist() == [2**45, 1] and m.dur_ns.tolist() == [2**33, 0]
    empty = decode_steps_v2(encode_steps_v2(
        job="j", rank=0, node="n", step=0, t_start_ns=0, t_end_ns=0, kind=[], name=[],
        group=[], seq=[], start_ns=[], dur_ns=[], bytes=[]))
    assert empty.n_ops == 0 and empty.coords == {} and tuple(empty.name) == ()


def test_v2_takes_under_half_the_bytes_of_json_compressed_or_not():
    import cramjam  # lz4, as the producers compress their batches

    v1 = b"".join(orjson.dumps(v) for v in _values())
    v2 = b"".join(encode_steps_value(v) for v in _values())
    assert len(v2) < len(v1) / 2  # 23 bytes per op against 57 (47-op steps)
    assert len(cramjam.lz4.compress(v2)) < 0.6 * len(cramjam.lz4.compress(v1))  # 9.8 vs 19.8


def test_a_template_is_restamped_in_place():
    raw = encode_steps_value(_values()[0])
    m = decode_steps_v2(restamp(raw, step=99, t_start_ns=10**18, t_end_ns=10**18 + 7))
    was = decode_steps_v2(raw)
    assert (m.step, m.t_start_ns, m.t_end_ns) == (99, 10**18, 10**18 + 7)
    np.testing.assert_array_equal(m.start_ns, was.start_ns)


def _with_head(raw: bytes, **fields: int) -> bytes:
    names = ("magic", "n_head", "rank", "local_rank", "step", "t_start_ns", "t_end_ns")
    head = dict(zip(names, HEAD.unpack_from(raw), strict=True))
    head.update(fields)
    return HEAD.pack(*head.values()) + raw[HEAD.size:]


def _header_of(raw: bytes) -> dict[str, Any]:
    n_head = HEAD.unpack_from(raw)[1]
    return orjson.loads(raw[HEAD.size:HEAD.size + n_head])


def _with_header(raw: bytes, **changes: Any) -> bytes:
    """The message with header fields changed; the columns as they were (the header keeps
    its padded length, so the columns stay where they were)."""
    n_head = HEAD.unpack_from(raw)[1]
    header = orjson.dumps({**_header_of(raw), **changes})
    room = n_head + (-(HEAD.size + n_head) % 8)
    assert len(header) <= room, "the change must not grow the header past its padding"
    header = header + b" " * (room - len(header))
    return _with_head(raw, n_head=len(header))[:HEAD.size] + header + raw[HEAD.size + room:]


def _base(**changes: Any) -> bytes:
    """A valid message, or with `changes` the encoder does not check (it trusts producers:
    the worker checks)."""
    fields: dict[str, Any] = dict(
        job="job-1", rank=3, node="node-1", step=7, t_start_ns=100, t_end_ns=150,
        kind=["compute", "coll", "p2p"], name=["fwd", "all_reduce", "send"],
        group=["", "dp.0", "pp.0-1"], seq=[0, 12, 3], start_ns=[0, 20, 35], dur_ns=[20, 30, 10],
        bytes=[0, 4096, 512])
    return encode_steps_v2(**{**fields, **changes})


def _column_at(raw: bytes, i: int) -> int:
    """Byte offset of column i."""
    h = _header_of(raw)
    pos = HEAD.size + HEAD.unpack_from(raw)[1]
    pos += -pos % 8
    for dt, size in zip(h["dtypes"][:i], h["sizes"][:i], strict=True):
        n = np.dtype(dt).itemsize * size
        pos += n + (-n % 8)
    return pos


def _set(raw: bytes, column: int, index: int, value: int) -> bytes:
    dt = np.dtype(_header_of(raw)["dtypes"][column]).newbyteorder("<")
    out = bytearray(raw)
    at = _column_at(raw, column) + index * dt.itemsize
    out[at:at + dt.itemsize] = np.array([value], dtype=dt).tobytes()
    return bytes(out)


@pytest.mark.parametrize(("mangle", "field"), [
    (lambda raw: raw[:20], "$"),
    (lambda raw: b"FLP1" + raw[4:], "$"),
    (lambda raw: raw[:-3], "$"),
    (lambda raw: _with_head(raw, rank=-1), "$.rank"),
    (lambda raw: _with_head(raw, rank=1 << 20), "$.rank"),
    (lambda raw: _with_head(raw, step=-1), "$.step"),
    (lambda raw: _with_head(raw, local_rank=-2), "$.local_rank"),
    (lambda raw: _with_head(raw, t_end_ns=99), "$.t_end_ns"),
    (lambda raw: raw[:HEAD.size] + b"[" + raw[HEAD.size + 1:], "$.header"),
    (lambda raw: _with_head(raw, n_head=10**6), "$.header"),
    (lambda raw: _with_header(raw, job=""), "$.header"),
    (lambda raw: _with_header(raw, dtypes=["f8"] * 8), "$.ops.kind"),
    (lambda raw: _with_header(raw, dtypes=["u1", "u1", "u1", "u1", "u1", "u8", "u1", "u1"]),
     "$.ops.dur_ns"),
    (lambda raw: _with_header(raw, dtypes=["u1"] * 7), "$.header"),
    (lambda raw: _with_header(raw, sizes=[3, 3, 2, 3, 3, 3, 3, 0]), "$.ops.group"),
    (lambda raw: _base(issue_ns=[0, 1]), "$.ops.issue_ns"),
    (lambda raw: _base(issue_ns=[0, -2, 1]), "$.ops.issue_ns[1]"),
    (lambda raw: _with_header(raw, groups=["", "dp", "pp.0-1"]), "$.header.groups[1]"),
    (lambda raw: _with_header(raw, names=["fwd"]), "$.ops.name"),
    (lambda raw: _set(raw, 0, 1, 3), "$.ops.kind"),
    (lambda raw: _set(raw, 2, 1, 0), "$.ops.group[1]"),
    (lambda raw: _base(dur_ns=[20, 30, -1]), "$.ops.dur_ns[2]"),
    (lambda raw: _base(start_ns=[0, -1, 35]), "$.ops.start_ns[1]"),
    (lambda raw: _base(bytes=[-4, 0, 0]), "$.ops.bytes[0]"),
], ids=["short", "magic", "truncated", "rank<0", "rank-too-big", "step<0", "local-rank<0",
        "ends-before-start", "header-json", "header-length", "empty-job", "float-column",
        "uint64-column",
        "seven-columns", "lengths", "issue-length", "issue<-1", "bad-group", "name-code",
        "kind-code", "coll-without-group", "negative-duration", "negative-start", "negative-bytes"])
def test_each_malformation_is_refused_with_the_field_at_fault(mangle, field):
    raw = mangle(_base())
    with pytest.raises(InvalidMessage) as e:
        decode_steps_v2(raw)
    assert e.value.field == field, e.value


def test_a_start_past_64_bits_and_an_oversized_message_are_refused():
    big = encode_steps_v2(job="j", rank=0, node="n", step=0, t_start_ns=0, t_end_ns=0,
                          kind=["compute"] * 3, name=["a"] * 3, group=[""] * 3,
                          seq=[0] * 3, start_ns=[2**62, 2**63 - 1, 0], dur_ns=[0] * 3,
                          bytes=[0] * 3)
    with pytest.raises(InvalidMessage) as e:
        decode_steps_v2(big)
    assert e.value.field == "$.ops.start_ns"
    with pytest.raises(InvalidMessage) as e:
        decode_steps_v2(_base(), max_bytes=100)
    assert "exceeds" in e.value.reason


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_any_corruption_is_a_step_or_an_invalid_message(data):
    raw = bytearray(_base())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        m = decode_steps_v2(bytes(raw[:cut] if data.draw(st.booleans()) else raw))
    except InvalidMessage:
        return
    assert m.n_ops == len(m.name) == len(m.group) == m.seq.size == m.start_ns.size
    assert (m.dur_ns >= 0).all() and (m.start_ns >= 0).all() and (m.bytes >= 0).all()


def test_the_head_is_the_documented_forty_bytes():
    raw = _base()
    assert HEAD.size == 40 and raw[:4] == MAGIC
    assert struct.unpack_from("<q", raw, 16)[0] == 7  # the step, where restamp writes it
