"""Wire contract v1: valid messages decode to columns, every malformed one says why."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import msgspec
import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import InvalidMessage
from schemas.decode import decode_heartbeat, decode_job, decode_steps
from schemas.jsonschema_gen import schema_documents
from schemas.steps_decoder import StepsDecoder

REPO = Path(__file__).resolve().parents[3]

GOOD = {
    "v": 1,
    "job": "gpt175b-r7",
    "rank": 17,
    "node": "node-002",
    "local_rank": 1,
    "step": 1234,
    "t_start_ns": 1790000000000000000,
    "t_end_ns": 1790000002100000000,
    "coords": {"tp": 1, "pp": 0, "dp": 2},
    "ops": {
        "kind": ["compute", "coll", "p2p"],
        "name": ["fwd", "all_reduce", "send"],
        "group": ["", "tp.2", "pp.17-25"],
        "seq": [0, 311, 12],
        "start_ns": [0, 5100000, 9800000],
        "dur_ns": [5000000, 800000, 300000],
        "bytes": [0, 16777216, 8388608],
    },
}


def test_design_example_decodes_to_columns_and_round_trips():
    m = decode_steps(orjson.dumps(GOOD))
    assert m.kind.tolist() == [0, 1, 2]
    assert m.dur_ns.dtype == np.int64 and m.dur_ns.tolist() == [5000000, 800000, 300000]
    assert m.coords == {"tp": 1, "pp": 0, "dp": 2}
    assert m.to_wire() == GOOD


def test_empty_step_is_valid():
    msg = copy.deepcopy(GOOD)
    msg["ops"] = {k: [] for k in msg["ops"]}
    assert decode_steps(orjson.dumps(msg)).n_ops == 0


def _bad(mutate) -> InvalidMessage:
    msg = copy.deepcopy(GOOD)
    mutate(msg)
    with pytest.raises(InvalidMessage) as e:
        decode_steps(orjson.dumps(msg))
    return e.value


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (lambda m: m.update(v=2), "$.v", "version"),
        (lambda m: m.pop("job"), "$", "job"),
        (lambda m: m.update(rank=-1), "$.rank", ">= 0"),
        (lambda m: m["ops"]["dur_ns"].__setitem__(1, -5), "$.ops.dur_ns[1]", "negative"),
        (lambda m: m["ops"]["seq"].pop(), "$.ops.seq", "entries"),
        (lambda m: m["ops"]["kind"].__setitem__(0, "gemm"), "$.ops.kind[0]", "Invalid"),
        (lambda m: m["ops"]["group"].__setitem__(1, "bogus"), "$.ops.group[1]", "<kind>.<id>"),
        (lambda m: m["ops"]["group"].__setitem__(1, ""), "$.ops.group[1]", "needs a group"),
        (lambda m: m.update(t_end_ns=0), "$.t_end_ns", "before"),
        (lambda m: m["ops"]["bytes"].__setitem__(0, "x"), "$.ops.bytes[0]", "int"),
    ],
)
def test_each_defect_names_its_field(mutate, field, words):
    err = _bad(mutate)
    assert err.field == field
    assert words in str(err)


def test_oversized_and_truncated_messages_are_rejected_with_a_reason():
    raw = orjson.dumps(GOOD)
    with pytest.raises(InvalidMessage, match="exceeds"):
        decode_steps(raw, max_bytes=100)
    with pytest.raises(InvalidMessage, match="truncated"):
        decode_steps(raw[:50])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise_anything_but_invalid_message(raw):
    for decode in (decode_steps, decode_heartbeat, decode_job):
        try:
            decode(raw)
        except InvalidMessage as exc:
            assert exc.reason
            assert exc.field.startswith("$")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(GOOD)), json_values)
def test_any_field_replaced_by_any_json_decodes_or_is_rejected_cleanly(field, value):
    msg = copy.deepcopy(GOOD)
    msg[field] = value
    try:
        m = decode_steps(json.dumps(msg).encode())
    except InvalidMessage as exc:
        assert exc.reason
    else:
        assert m.n_ops == len(m.name) == len(m.group) == m.seq.size


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(GOOD["ops"])), st.integers(0, 2), json_values)
def test_any_op_entry_replaced_decodes_or_is_rejected_cleanly(field, i, value):
    msg = copy.deepcopy(GOOD)
    msg["ops"][field][i] = value
    try:
        decode_steps(json.dumps(msg).encode())
    except InvalidMessage as exc:
        assert exc.field.startswith("$")


def test_heartbeat_and_job_events_decode():
    hb = decode_heartbeat(
        orjson.dumps(
            {
                "v": 1,
                "job": "j",
                "rank": 3,
                "node": "n",
                "ts_ns": 5,
                "step": 9,
                "inflight": [{"group": "tp.0", "name": "all_reduce", "seq": 4, "start_ns": 1}],
            }
        )
    )
    assert hb.inflight[0].seq == 4
    ev = decode_job(orjson.dumps({"v": 1, "job": "j", "event": "end", "ts_ns": 5}))
    assert ev.event == "end"
    with pytest.raises(InvalidMessage, match="world_size"):
        decode_job(orjson.dumps({"v": 1, "job": "j", "event": "start", "ts_ns": 5}))


def test_checked_in_json_schemas_are_the_generated_ones():
    for name, doc in schema_documents().items():
        path = REPO / "schemas" / "jsonschema" / name
        assert path.read_bytes() == doc, f"{path} is stale: run `flare schemas`"


def test_json_schema_accepts_the_design_example():
    jsonschema = pytest.importorskip("jsonschema")
    schema = msgspec.json.decode(schema_documents()["flare.steps.v1.json"])
    jsonschema.validate(GOOD, schema)


def _answer(decode, raw: bytes) -> tuple:
    try:
        m = decode(raw)
    except InvalidMessage as exc:
        return ("invalid", exc.field, exc.reason)
    return ("ok", m.to_wire(), m.seq.dtype, m.kind.dtype)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(GOOD)), st.sampled_from(sorted(GOOD["ops"])), st.integers(0, 2),
       json_values, st.booleans())
def test_the_worker_decoder_answers_like_decode_steps(field, op_field, i, value, in_ops):
    dec = StepsDecoder()
    assert _answer(dec.decode, orjson.dumps(GOOD)) == _answer(decode_steps, orjson.dumps(GOOD))
    msg = copy.deepcopy(GOOD)
    if in_ops:
        msg["ops"][op_field][i] = value
    else:
        msg[field] = value
    raw = json.dumps(msg).encode()
    assert _answer(dec.decode, raw) == _answer(decode_steps, raw)


def test_the_optional_issue_column_is_accepted_checked_and_old_messages_stay_valid():
    """GPU-side timing adds `ops.issue_ns` within v1: a message with it decodes like the one
    without, a column of another length or below -1 says so, and the JSON Schema agrees."""
    gpu = copy.deepcopy(GOOD)
    gpu["ops"]["issue_ns"] = [-1, 42000, 0]
    old, new = decode_steps(orjson.dumps(GOOD)), decode_steps(orjson.dumps(gpu))
    assert new.to_wire() == old.to_wire() == GOOD  # the column is checked, not carried (yet)
    assert decode_steps(orjson.dumps({**gpu, "ops": {**gpu["ops"], "issue_ns": None}})).n_ops == 3
    for issue, field, words in (([1, 2], "$.ops.issue_ns", "has 2 entries but ops.kind has 3"),
                                ([1, 2, 3, 4], "$.ops.issue_ns", "has 4 entries"),
                                ([1, -2, 3], "$.ops.issue_ns[1]", ">= -1")):
        bad = {**gpu, "ops": {**gpu["ops"], "issue_ns": issue}}
        with pytest.raises(InvalidMessage) as exc:
            decode_steps(orjson.dumps(bad))
        assert exc.value.field == field and words in exc.value.reason
    jsonschema = pytest.importorskip("jsonschema")
    schema = msgspec.json.decode(schema_documents()["flare.steps.v1.json"])
    jsonschema.validate(gpu, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**gpu, "ops": {**gpu["ops"], "issue_ns": [0, -5, 0]}}, schema)
