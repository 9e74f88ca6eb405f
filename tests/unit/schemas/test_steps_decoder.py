"""StepsDecoder: the worker's cached decoder answers exactly like the plain `decode_steps`.

Every test compares the two on the same bytes: same RankStep for a valid message, same
`InvalidMessage` (field path and reason) for a bad one, whatever the decoder cached before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from unittest.mock import create_autospec

import msgspec
import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import UnsetType

from detectors.diagnoser import JobDiagnoser
from producers.simulator import ClusterSimulator, Scenario, layout_for_gpus
from schemas import InvalidMessage
from schemas import steps_decoder as sd
from schemas.decode import decode_steps
from schemas.report import DiagnoserOutput
from schemas.steps_decoder import StepsDecoder
from schemas.topics import STEPS
from schemas.wire import Coords, Ops, StepsV1
from streams.routing import JobRouter

I64_MAX, I64_MIN = 2**63 - 1, -(2**63)
COLUMNS = ("kind", "name", "group", "seq", "start_ns", "dur_ns", "bytes")


def outcome(decode: Any, raw: bytes) -> tuple:
    """What a decoder makes of `raw`, in a comparable form."""
    try:
        m = decode(raw)
    except InvalidMessage as exc:
        return ("invalid", exc.field, exc.reason)
    cols = []
    for f in ("kind", "seq", "start_ns", "dur_ns", "bytes"):
        a = getattr(m, f)
        cols.append((f, str(a.dtype), a.tolist()))
    return ("ok", m.job, m.rank, m.node, m.step, m.t_start_ns, m.t_end_ns, m.local_rank,
            dict(m.coords), list(m.name), list(m.group), cols)


def assert_same(dec: StepsDecoder, raw: bytes) -> tuple:
    want = outcome(decode_steps, raw)
    assert outcome(dec.decode, raw) == want
    return want


# ---- a JSON writer that can repeat keys and vary its layout ---------------------------------
@dataclass
class Obj:
    """A JSON object as ordered (key, value) pairs, so a key may appear twice."""

    pairs: list[tuple[str, Any]]


@dataclass(frozen=True)
class Style:
    comma: str = ","
    colon: str = ":"
    ascii: bool = False


def dumps(v: Any, s: Style) -> str:
    if isinstance(v, Obj):
        body = s.comma.join(f"{json.dumps(k, ensure_ascii=s.ascii)}{s.colon}{dumps(x, s)}"
                            for k, x in v.pairs)
        return "{" + body + "}"
    if isinstance(v, list):
        return "[" + s.comma.join(dumps(x, s) for x in v) + "]"
    return json.dumps(v, ensure_ascii=s.ascii)


def message(cols: dict[str, list], *, job: str = "j", rank: int = 3, node: str = "n0",
            step: int = 7, t0: int = 10**18, t1: int = 10**18 + 5, extra: list | None = None,
            ops_extra: list | None = None, coords: Any = "absent",
            local_rank: Any = "absent") -> Obj:
    top: list[tuple[str, Any]] = [("v", 1), ("job", job), ("rank", rank), ("node", node),
                                  ("step", step), ("t_start_ns", t0), ("t_end_ns", t1)]
    optional = [("issue_ns", cols["issue_ns"])] if "issue_ns" in cols else []
    ops = Obj([(c, cols[c]) for c in COLUMNS] + optional + (ops_extra or []))
    top.append(("ops", ops))
    if local_rank != "absent":
        top.append(("local_rank", local_rank))
    if coords != "absent":
        top.append(("coords", coords))
    return Obj(top + (extra or []))


def columns(kinds: list[str], groups: list[str], *, names: list[str] | None = None,
            base: int = 0) -> dict[str, list]:
    n = len(kinds)
    return {
        "kind": kinds, "name": names or [f"op{i % 3}" for i in range(n)], "group": groups,
        "seq": [base + i for i in range(n)], "start_ns": [1000 * i + base for i in range(n)],
        "dur_ns": [500 + i for i in range(n)], "bytes": [64 * i for i in range(n)],
    }


def raw_of(o: Obj, s: Style = Style()) -> bytes:
    return dumps(o, s).encode()


GOOD_COLS = columns(["compute", "coll", "p2p"], ["", "tp.2", "pp.17-25"])


# ---- hypothesis: random valid and invalid messages, in sequences for one rank ---------------
styles = st.builds(Style, st.sampled_from([",", ", ", " ,\n\t"]),
                   st.sampled_from([":", ": ", " :\r\n"]), st.booleans())
names = st.sampled_from(["fwd", "bwd", "all_reduce", "aten::mm", "é", 'q"uote', "b\\s", ""])
good_groups = st.sampled_from(["tp.0", "dp.1-2", "pp.3", "world.x", "pg.7", "ep.a:b"])
bad_groups = st.sampled_from(["bogus", "tp.", "xx.1", ".1", ""])
ints = st.one_of(
    st.integers(0, 10**12),
    st.sampled_from([I64_MAX, I64_MIN, I64_MAX + 1, I64_MIN - 1, 2**64, -1, 10**30, -(10**30)]),
    st.integers(-(2**70), 2**70),
)
not_ints = st.sampled_from([1.0, 1e3, "1", None, True, [1], {"a": 1}, -0.0])
json_any = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda c: st.lists(c, max_size=3), max_leaves=6,
)


@st.composite
def op_columns(draw: st.DrawFn) -> dict[str, list]:
    n = draw(st.integers(0, 6))
    kinds = draw(st.lists(st.sampled_from(["compute", "coll", "p2p"]), min_size=n, max_size=n))
    groups = [draw(good_groups) if k != "compute" else "" for k in kinds]
    return columns(kinds, groups, names=draw(st.lists(names, min_size=n, max_size=n)))


@st.composite
def mutated(draw: st.DrawFn, cols: dict[str, list]) -> Obj:
    """One message built on `cols`, possibly broken in one of many ways."""
    cols = {k: list(v) for k, v in cols.items()}
    n = len(cols["kind"])
    kw: dict[str, Any] = {}
    how = draw(st.sampled_from([
        *["valid"] * 8, "int", "not_int", "bad_group", "no_group", "bad_kind",
        "length", "t_end", "dup_op", "dup_top", "dup_ops", "unknown", "coords", "local_rank",
        "column_any", *["issue"] * 3, "issue_bad",
    ]))
    if how == "int" and n:
        cols[draw(st.sampled_from(COLUMNS[3:]))][draw(st.integers(0, n - 1))] = draw(ints)
    elif how == "not_int" and n:
        cols[draw(st.sampled_from(COLUMNS[3:]))][draw(st.integers(0, n - 1))] = draw(not_ints)
    elif how == "bad_group" and n:
        cols["group"][draw(st.integers(0, n - 1))] = draw(bad_groups)
    elif how == "no_group" and n:
        cols["kind"] = ["coll"] * n
    elif how == "bad_kind" and n:
        cols["kind"][draw(st.integers(0, n - 1))] = draw(st.sampled_from(["gemm", "", 3]))
    elif how == "length":
        c = draw(st.sampled_from(COLUMNS))
        cols[c] = cols[c][:-1] if cols[c] and draw(st.booleans()) else cols[c] + cols[c][:1]
    elif how == "t_end":
        kw["t1"] = 10**18 - 1
    elif how == "dup_op":  # the same op column twice: first or last one broken
        c = draw(st.sampled_from(COLUMNS))
        kw["ops_extra"] = [(c, draw(json_any | st.just(cols[c])))]
        if draw(st.booleans()):
            kw["ops_extra"] = [(c, cols[c])]
            cols[c] = draw(json_any)
    elif how == "dup_top":
        kw["extra"] = [(draw(st.sampled_from(["job", "rank", "v", "node", "step"])),
                        draw(json_any | st.just("j")))]
    elif how == "dup_ops":  # a second "ops" object, before (broken) or after the real one
        kw["extra"] = [("ops", Obj([(c, draw(json_any)) for c in COLUMNS]))]
    elif how == "unknown":
        kw["extra"] = [(draw(st.sampled_from(["extra", "seq", "a:b"])), draw(json_any))]
    elif how == "coords":
        kw["coords"] = draw(st.one_of(
            st.none(), json_any,
            st.dictionaries(st.sampled_from(["tp", "pp", "dp", "ep", "cp", "zz"]),
                            st.none() | st.integers(-1, 9), max_size=4).map(
                lambda d: Obj(list(d.items()))),
        ))
    elif how == "local_rank":
        kw["local_rank"] = draw(st.none() | st.integers(-2, 9) | json_any)
    elif how == "column_any":
        cols[draw(st.sampled_from(COLUMNS))] = draw(json_any)
    elif how == "issue":  # the optional GPU column, valid: n latencies >= -1, or null
        kw["ops_extra"] = [("issue_ns", draw(st.none() | st.lists(
            st.integers(-1, 10**12), min_size=n, max_size=n)))]
    elif how == "issue_bad":  # ... or not: a wrong length, a value out of range, any JSON
        good = [0] * n
        kw["ops_extra"] = [("issue_ns", draw(st.one_of(
            st.just(good + [0]), st.just(good[1:]), json_any,
            st.lists(ints | not_ints, min_size=n, max_size=n))))]
    return message(cols, rank=draw(st.sampled_from([0, 0, 0, 1, 2])), **kw)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_cached_decoder_equals_plain_decode_on_sequences_of_valid_and_bad_messages(data):
    dec = StepsDecoder(max_bytes=4096, max_ranks=2)
    base, style = data.draw(op_columns()), data.draw(styles)
    for _ in range(data.draw(st.integers(1, 6))):
        if data.draw(st.integers(0, 3)) == 0:  # the rank's columns change between steps
            base = data.draw(op_columns())
        if data.draw(st.integers(0, 5)) == 0:  # so does the text of the same columns
            style = data.draw(styles)
        assert_same(dec, raw_of(data.draw(mutated(base)), style))
    assert len(dec) <= 2


@settings(max_examples=200, deadline=None)
@given(st.lists(ints, min_size=4, max_size=4), st.integers(0, 2))
def test_any_64_bit_boundary_value_is_parsed_or_refused_exactly_as_before(vals, i):
    dec = StepsDecoder()
    assert_same(dec, raw_of(message(GOOD_COLS)))
    cols = {k: list(v) for k, v in GOOD_COLS.items()}
    for c, v in zip(COLUMNS[3:], vals, strict=True):
        cols[c][i] = v
    assert_same(dec, raw_of(message(cols)))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([bytes, bytearray, memoryview]))
def test_arbitrary_bytes_get_the_same_answer(raw, kind):
    dec = StepsDecoder()
    assert outcome(dec.decode, kind(raw)) == outcome(decode_steps, raw)


# ---- named cases ---------------------------------------------------------------------------
def test_the_raw_models_mirror_the_wire_models_field_for_field():
    """A v1 extension of StepsV1 must reach the raw models too, or every message falls back."""
    def same_fields(wire: type, raw: type, skip: set[str]) -> None:
        w, r = msgspec.structs.fields(wire), msgspec.structs.fields(raw)
        assert [f.name for f in w] == [f.name for f in r]
        for a, b in zip(w, r, strict=True):
            if a.name not in skip:
                assert b.type in (a.type, a.type | UnsetType), a.name

    same_fields(StepsV1, sd._RawSteps, {"ops", "coords"})
    same_fields(Ops, sd._RawOps, {*COLUMNS, "issue_ns"})  # the op columns stay raw text
    assert msgspec.structs.fields(sd._RawOps)[-1].default is msgspec.UNSET  # issue_ns: optional
    same_fields(Coords, sd._SeenCoords, set())
    assert sd._REQUIRED_KEYS == 8 + len(COLUMNS)



def test_simulated_steps_decode_equal_and_hit_the_cache_after_the_first_step():
    sc = Scenario(job="c", layout=layout_for_gpus(64), steps=3, seed=2, microbatches=4,
                  chunks=2, heartbeats=False)
    sim = ClusterSimulator(sc)
    dec = StepsDecoder()
    frames = [f for f in sim.run() if not hasattr(f, "inflight")]
    for f in frames:
        for m in sim.rank_steps(f):
            assert assert_same(dec, orjson.dumps(m.to_wire()))[0] == "ok"
    assert dec.fallbacks == 0
    assert dec.misses == 64 and dec.hits == 64 * (len(frames) - 1)


def test_a_rank_whose_groups_change_gets_the_new_groups():
    dec = StepsDecoder()
    assert_same(dec, raw_of(message(GOOD_COLS)))
    changed = dict(GOOD_COLS, group=["", "tp.3", "pp.17-25"])
    got = dec.decode(raw_of(message(changed)))
    assert list(got.group) == ["", "tp.3", "pp.17-25"]
    assert_same(dec, raw_of(message(changed)))
    assert_same(dec, raw_of(message(GOOD_COLS)))


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"group": ["", "bogus", "pp.1"]}, "$.ops.group[1]", "<kind>.<id>"),
    ({"group": ["", "", "pp.1"]}, "$.ops.group[1]", "needs a group"),
    ({"kind": ["compute", "gemm", "p2p"]}, "$.ops.kind[1]", "Invalid enum value 'gemm'"),
    ({"dur_ns": [1, -5, 2]}, "$.ops.dur_ns[1]", "negative"),
    ({"bytes": [1, 2, 2**64]}, "$.ops", "does not fit in 64 bits"),
    ({"seq": [0, 1.0, 2]}, "$.ops.seq[1]", "Expected `int`, got `float`"),
    ({"start_ns": [0, 1]}, "$.ops.start_ns", "has 2 entries but ops.kind has 3"),
    ({"name": ["a", "b"]}, "$.ops.name", "has 2 entries but ops.kind has 3"),
    ({"issue_ns": [5, -1]}, "$.ops.issue_ns", "has 2 entries but ops.kind has 3"),
    ({"issue_ns": [5, -2, 0]}, "$.ops.issue_ns[1]", ">= -1"),
    ({"issue_ns": [5, 2**63, 0]}, "$.ops", "does not fit in 64 bits"),
    ({"issue_ns": "1,2,3"}, "$.ops.issue_ns", "Expected `array | null`"),
])
def test_an_invalid_message_after_a_cached_valid_one_of_the_same_rank_says_the_same(
        change, field, words):
    dec = StepsDecoder()
    for _ in range(2):
        assert assert_same(dec, raw_of(message(GOOD_COLS)))[0] == "ok"
    want = assert_same(dec, raw_of(message(dict(GOOD_COLS, **change))))
    assert want[:2] == ("invalid", field) and words in want[2]
    assert assert_same(dec, raw_of(message(GOOD_COLS)))[0] == "ok"  # and it recovers


@pytest.mark.parametrize("first_is_bad", [True, False])
def test_a_repeated_key_is_judged_as_the_plain_decoder_judges_it(first_is_bad):
    dec = StepsDecoder()
    assert_same(dec, raw_of(message(GOOD_COLS)))
    bad = ["x", "y", "z"]
    ops_extra = [("seq", GOOD_COLS["seq"] if first_is_bad else bad)]
    cols = dict(GOOD_COLS, seq=bad) if first_is_bad else GOOD_COLS
    want = assert_same(dec, raw_of(message(cols, ops_extra=ops_extra)))
    assert want[0] == "invalid"
    top = raw_of(message(GOOD_COLS, extra=[("ops", Obj([("kind", [1])]))]))
    assert assert_same(dec, top)[0] == "invalid"


def test_kind_names_and_groups_are_shared_immutable_and_the_int_columns_the_callers_own():
    dec = StepsDecoder()
    raw = raw_of(message(GOOD_COLS))
    a, b = dec.decode(raw), dec.decode(raw)
    assert a.kind is b.kind and not a.kind.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        a.kind[0] = 2
    assert a.name is b.name and a.group is b.group and isinstance(a.name, tuple)
    a.seq[0] = -7
    c = dec.decode(raw)
    assert list(c.name) == GOOD_COLS["name"] and list(c.group) == GOOD_COLS["group"]
    assert c.seq[0] == 0
    for arr in (c.seq, c.start_ns, c.dur_ns, c.bytes):
        assert arr.flags.writeable and arr.dtype == np.int64


def test_memory_is_bounded_by_the_cap_and_by_forgetting_jobs():
    dec = StepsDecoder(max_ranks=3)
    for job in ("a", "b"):
        for rank in range(3):
            dec.decode(raw_of(message(GOOD_COLS, job=job, rank=rank)))
    assert len(dec) == 3
    assert dec.forget("b") == 3 and len(dec) == 0
    dec.decode(raw_of(message(GOOD_COLS, job="a", rank=0)))
    assert dec.misses == 7 and dec.hits == 0


def test_unusual_but_valid_messages_take_the_plain_path_and_still_decode():
    dec = StepsDecoder()
    escaped = dict(GOOD_COLS, name=["fwd", "é", "send"])
    for obj, style in [
        (message(escaped, node="host:1"), Style(ascii=True)),  # an escape, and a colon
        (message(columns([], [])), Style()),  # an empty step
        (message(GOOD_COLS, extra=[("future_field", {"k": 1})]), Style()),  # v1 extension
    ]:
        assert assert_same(dec, raw_of(obj, style))[0] == "ok"
    assert dec.fallbacks == 3
    for obj in (message(escaped, node="host:1"), message(GOOD_COLS, coords=None)):
        assert assert_same(dec, raw_of(obj))[0] == "ok"
    assert dec.fallbacks == 3


def test_the_worker_router_owns_one_decoder_and_forgets_a_revoked_job():
    def make(job: str) -> Any:
        fake = create_autospec(JobDiagnoser, spec_set=True, instance=True)
        fake.on_steps.return_value = DiagnoserOutput()
        return fake

    r = JobRouter(make, max_message_bytes=10_000, now_ns=lambda: 0)
    raw = raw_of(message(GOOD_COLS, job="j1"))
    for off in range(2):
        assert r.handle(STEPS, 0, off, b"j1", raw).dead_letter is None
    assert r.steps_decoder.hits == 1 and len(r.steps_decoder) == 1
    assert r.revoke([0]) == ["j1"]
    assert len(r.steps_decoder) == 0


def test_the_optional_gpu_column_stays_on_the_fast_path_and_old_messages_too():
    dec = StepsDecoder()
    for cols in (GOOD_COLS, dict(GOOD_COLS, issue_ns=[-1, 250, 0]),
                 dict(GOOD_COLS, issue_ns=None), GOOD_COLS):
        assert assert_same(dec, raw_of(message(cols), Style(", ", ": ")))[0] == "ok"
    assert dec.fallbacks == 0 and dec.hits == 3
    for bad in ([-1, 250], [0, -2, 0], [0, 2**63, 0]):  # proved wrong, or in doubt: plain path
        assert assert_same(dec, raw_of(message(dict(GOOD_COLS, issue_ns=bad))))[0] != "ok"
    assert dec.fallbacks == 3
