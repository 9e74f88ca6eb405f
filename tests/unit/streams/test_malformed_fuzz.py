"""Bad input, fuzzed (issue #16): every malformed message is dead-lettered once, under the
cause it deserves, and the good messages around it are diagnosed as if it were not there.

Each family of malformations below is a hypothesis strategy that starts from valid messages
of a small faulty job (one slow GPU) and breaks them one way. A family's test draws its
`quota` of messages (derandomized: the same ones on every run, no example database),
checks each one alone through the worker's router, then interleaves all of them with the
job's good messages and runs the worker's pipeline (`streams.pipeline`, real diagnosers,
rows in memory). It must find exactly the clean run's incidents and reports, one dead letter
per malformed message (its coordinates, its bytes, a reason) and dead-letter counters (the
router's and the `flare_worker_dead_letters_total` metric) equal to the expected causes,
counted once each. The families add up to more than 10,000 messages.

The expected cause of a message is written here from the wire contract (schemas/wire.py),
not asked of the decoder: a message dead-lettered under another field's name fails.

The same strategies feed the broker test (tests/integration/test_malformed_broker.py) and
load-tests/fuzz_malformed.py, so they take the job id and the size limit as arguments.
"""

from __future__ import annotations

import base64
import copy
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from detectors.diagnoser import JobDiagnoser
from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus
from schemas import InvalidMessage
from schemas.decode import DEFAULT_MAX_BYTES, decode_steps
from schemas.rankstep import KIND_CODE
from schemas.report import StepReport
from schemas.steps_v2 import HEAD as V2_HEAD
from schemas.steps_v2 import decode_steps_v2, encode_steps_v2, encode_steps_value
from schemas.testing import FakeClock
from schemas.topics import (
    DEADLETTER,
    HEARTBEATS,
    INCIDENTS,
    INPUT_TOPICS,
    JOBS,
    STEPS,
    STEPS_V2,
)
from schemas.wire import MAX_RANKS, DeadLetterV1, IncidentV1
from storage.testing import MemoryStore
from streams.deadletter import MAX_PAYLOAD_BYTES
from streams.pipeline import Pipeline, Record, build_pipeline
from streams.routing import JobRouter, Routed

JOB = "fuzz-job"
OP_KINDS = ("compute", "coll", "p2p")
GROUP_KINDS = ("tp", "dp", "pp", "ep", "cp", "world", "pg")  # DESIGN §3: "<kind>.<id>"
COLUMNS = ("kind", "name", "group", "seq", "start_ns", "dur_ns", "bytes")
I64_MAX = 2**63 - 1
TEN_MB = 10 * 1024 * 1024


# ---- the good job and the messages the families start from ---------------------------------

def good_messages(job: str = JOB) -> list[tuple[str, bytes]]:
    """A small faulty job as its producers send it: (topic, value), in publish order."""
    scenario = Scenario(job=job, layout=layout_for_gpus(8), steps=30, seed=3,
                        fault=Fault("slow_gpu", 1.5, 10, None), step_time_s=0.5)
    return [(topic, orjson.dumps(value))
            for topic, _key, value, _ts in ClusterSimulator(scenario).events()]


@dataclass(frozen=True, slots=True)
class Templates:
    """Valid messages of the job, one of each shape. Its properties are fresh copies to
    break (a JSON round trip: ~20x cheaper than `copy.deepcopy`, which hypothesis would
    otherwise spend most of its time in)."""

    job: str
    raw: dict[str, tuple[str, bytes]]  # shape -> (topic, value)

    def fresh(self, shape: str) -> dict[str, Any]:
        return orjson.loads(self.raw[shape][1])  # type: ignore[no-any-return]

    @property
    def steps(self) -> dict[str, Any]:
        return self.fresh("steps")

    @property
    def heartbeat(self) -> dict[str, Any]:  # with ops in flight
        return self.fresh("heartbeat")

    @property
    def stack_heartbeat(self) -> dict[str, Any]:
        """The heartbeat with the hang forensics fields (stacks, a process state)."""
        return self.fresh("stack_heartbeat")

    @property
    def start(self) -> dict[str, Any]:  # with layout and nodes
        return self.fresh("start")

    def shapes(self) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
        """Any valid shape (the steps also with the optional GPU-timing column, the
        heartbeat also with stacks; job start and end), a fresh copy, with its topic."""
        return st.sampled_from(sorted(self.raw)).map(
            lambda shape: (self.raw[shape][0], self.fresh(shape)))


def templates(job: str = JOB) -> Templates:
    msgs = [(t, orjson.loads(v)) for t, v in good_messages(job)]
    steps = next(m for t, m in msgs if t == STEPS and "coll" in m["ops"]["kind"])
    hb = next(m for t, m in msgs if t == HEARTBEATS and m.get("inflight"))
    start = next(m for t, m in msgs if t == JOBS and m["event"] == "start")
    end = next(m for t, m in msgs if t == JOBS and m["event"] == "end")
    assert start.get("layout") and start.get("nodes")
    gpu = copy.deepcopy(steps)
    gpu["ops"]["issue_ns"] = [-1 if k == "compute" else 1500 for k in gpu["ops"]["kind"]]
    stacks = {**hb, "stacks_ts_ns": hb["ts_ns"], "proc_state": "blocked",
              "stacks": [{"thread": "MainThread", "training": True,
                          "frames": ["train.py:88 in main", "train.py:41 in step"]},
                         {"thread": "pin_memory", "frames": ["loader.py:9 in run"]}]}
    shapes = {"steps": (STEPS, steps), "gpu_steps": (STEPS, gpu), "heartbeat": (HEARTBEATS, hb),
              "stack_heartbeat": (HEARTBEATS, stacks), "start": (JOBS, start),
              "end": (JOBS, end)}
    return Templates(job, {k: (t, orjson.dumps(m)) for k, (t, m) in shapes.items()})


@dataclass(frozen=True, slots=True)
class Malformed:
    """One bad input and the dead-letter cause (the counter's label) it must get."""

    family: str
    topic: str
    key: bytes | None
    value: bytes | None
    cause: str

    def __repr__(self) -> str:  # a 10 MB value must not flood a failure report
        v = self.value if self.value is None or len(self.value) < 300 else (
            self.value[:300] + b"...(%d bytes)" % len(self.value))
        return (f"Malformed({self.family}, {self.topic}, key={self.key!r}, "
                f"cause={self.cause}, {v!r})")


# ---- values of the wrong kind ---------------------------------------------------------------

_SCALARS: dict[type, st.SearchStrategy[Any]] = {
    type(None): st.none(), bool: st.booleans(), int: st.integers(-(2**70), 2**70),
    float: st.floats(allow_nan=False, allow_infinity=False), str: st.text(max_size=12),
}
_ANY_SCALAR = st.one_of(*_SCALARS.values())
_JSON_KINDS: dict[type, st.SearchStrategy[Any]] = {
    **_SCALARS,
    list: st.lists(_ANY_SCALAR, max_size=3),
    dict: st.dictionaries(st.text(max_size=6), _ANY_SCALAR, max_size=3),
}


def not_a(*types: type, null_ok: bool = False) -> st.SearchStrategy[Any]:
    """A JSON value of none of `types` (bool is not int here, as in JSON); never null when
    null is a valid value of the field."""
    skip = set(types) | ({type(None)} if null_ok else set())
    return st.one_of(*(s for ty, s in _JSON_KINDS.items() if ty not in skip))


NEGATIVE = st.integers(-(2**70), -1)
ABOVE_I64 = st.integers(I64_MAX + 1, 2**70)
OUT_OF_I64 = st.one_of(ABOVE_I64, st.integers(-(2**70), -(2**63) - 1))
BAD_INT64 = st.one_of(not_a(int), OUT_OF_I64)
BAD_NONNEG = st.one_of(not_a(int), NEGATIVE, ABOVE_I64)
BAD_OPT_NONNEG = st.one_of(not_a(int, null_ok=True), NEGATIVE, ABOVE_I64)
BAD_NAME = st.one_of(not_a(str), st.just(""), st.integers(257, 4000).map(lambda n: "n" * n))
BAD_VERSION = st.one_of(st.integers(-(2**70), 2**70).filter(lambda v: v != 1), not_a(int))


def bad_choice(*allowed: str, null_ok: bool = False) -> st.SearchStrategy[Any]:
    return st.one_of(st.text(max_size=12).filter(lambda s: s not in allowed),
                     not_a(str, null_ok=null_ok))


STEPS_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "v": BAD_VERSION, "job": BAD_NAME, "rank": BAD_NONNEG, "node": BAD_NAME,
    "step": BAD_NONNEG, "t_start_ns": BAD_INT64, "t_end_ns": BAD_INT64, "ops": not_a(dict),
    "local_rank": BAD_NONNEG, "coords": not_a(dict, null_ok=True),
}
HEARTBEAT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "v": BAD_VERSION, "job": BAD_NAME, "rank": BAD_NONNEG, "node": BAD_NAME,
    "ts_ns": BAD_INT64, "step": BAD_NONNEG, "inflight": not_a(list),
    "exited": bad_choice("vanished", null_ok=True), "exit_reason": not_a(str, null_ok=True),
    "exit_stack": st.one_of(not_a(list, null_ok=True), st.lists(not_a(str), min_size=1,
                                                                max_size=3)),
    "stacks": not_a(list, null_ok=True),
    "stacks_ts_ns": st.one_of(not_a(int, null_ok=True), OUT_OF_I64),
    "proc_state": bad_choice("stopped", "frozen", "blocked", null_ok=True),
}
START_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "v": BAD_VERSION, "job": BAD_NAME, "event": bad_choice("start", "end"),
    "ts_ns": BAD_INT64, "world_size": BAD_NONNEG, "layout": not_a(dict, null_ok=True),
    "nodes": not_a(list, null_ok=True), "topology": not_a(list, null_ok=True),
}
END_FIELDS = {**START_FIELDS, "world_size": BAD_OPT_NONNEG}


def fields_of(topic: str, m: dict[str, Any]) -> dict[str, st.SearchStrategy[Any]]:
    if topic == STEPS:
        return STEPS_FIELDS
    if topic == HEARTBEATS:
        return HEARTBEAT_FIELDS
    return START_FIELDS if m["event"] == "start" else END_FIELDS


def dumps(m: Any) -> bytes:
    """Compact JSON, integers beyond 64 bits included (orjson refuses them)."""
    return msgspec.json.encode(m)


def path_cause(*parts: str) -> str:
    return "$." + ".".join(parts)


# ---- the families ---------------------------------------------------------------------------

Family = Callable[[Templates, int], st.SearchStrategy[Malformed]]


@st.composite
def wrong_types(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """One top-level field of any message of a value of the wrong type or range, or a
    nested one (coords, layout, nodes, ops in flight, stacks)."""
    topic, m = draw(t.shapes())
    nested = draw(st.booleans())
    if nested and topic == STEPS:
        dim = draw(st.sampled_from(["tp", "pp", "dp", "ep", "cp"]))
        m["coords"] = {**(m.get("coords") or {}), dim: draw(BAD_OPT_NONNEG)}
        cause = path_cause("coords", dim)
    elif nested and topic == HEARTBEATS:
        cause = draw(st.sampled_from(["inflight", "stacks"]))
        if cause == "inflight":
            ops = m["inflight"]
            i = draw(st.integers(0, len(ops) - 1))
            key = draw(st.sampled_from(["group", "name", "seq", "start_ns", ""]))
            if key == "":  # an op that is not an object
                ops[i] = draw(not_a(dict))
                cause = path_cause("inflight")
            else:
                ops[i][key] = draw(not_a(str) if key in ("group", "name") else BAD_INT64)
                cause = path_cause("inflight", key)
        else:
            stacks = t.stack_heartbeat["stacks"]
            i = draw(st.integers(0, len(stacks) - 1))
            key = draw(st.sampled_from(["thread", "frames", "frame", "training"]))
            if key == "frame":
                frames = stacks[i]["frames"]
                frames[draw(st.integers(0, len(frames) - 1))] = draw(not_a(str))
                key = "frames"
            else:
                stacks[i][key] = draw({"thread": not_a(str), "frames": not_a(list),
                                       "training": not_a(bool)}[key])
            m["stacks"] = stacks
            cause = path_cause("stacks", key)
    elif nested and topic == JOBS:
        where = draw(st.sampled_from(["layout", "nodes", "topology"]))
        if where == "layout":
            dim = draw(st.sampled_from(["tp", "pp", "dp", "ep"]))
            m["layout"] = {**(m.get("layout") or {}), dim: draw(BAD_OPT_NONNEG)}
            cause = path_cause("layout", dim)
        else:
            nodes = t.start["nodes"]
            i = draw(st.integers(0, len(nodes) - 1))
            key = draw(st.sampled_from(["node", "switch"]))
            nodes[i][key] = draw(BAD_NAME if key == "node" else not_a(str, null_ok=True))
            m[where] = nodes
            cause = path_cause(where, key)
    else:
        name, bad = draw(st.sampled_from(sorted(fields_of(topic, m).items())))
        m[name] = draw(bad)
        cause = path_cause(name)
    return Malformed("wrong_types", topic, t.job.encode(), dumps(m), cause)


@st.composite
def bad_op_values(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """One entry of one op column: a wrong type, an unknown kind, a bad or missing group,
    a negative time or size, an integer beyond 64 bits."""
    m = draw(st.sampled_from(["steps", "gpu_steps"]).map(t.fresh))
    ops = m["ops"]
    col = draw(st.sampled_from(COLUMNS + ("issue_ns",)))
    if col == "issue_ns" and "issue_ns" not in ops:
        ops["issue_ns"] = [0] * len(ops["kind"])
    i = draw(st.integers(0, len(ops["kind"]) - 1))
    cause = path_cause("ops", col)
    how = draw(st.sampled_from(["type", "value"]))
    if col == "kind":
        ops[col][i] = draw(bad_choice(*OP_KINDS))
    elif col == "name":
        ops[col][i] = draw(not_a(str))
    elif col == "group":
        if how == "type":
            ops[col][i] = draw(not_a(str))
        else:
            needs = [j for j, k in enumerate(ops["kind"]) if k != "compute"]
            choice = draw(st.sampled_from(["no dot", "bad kind", "no id", "missing"]))
            if choice == "missing":  # a coll or p2p op without its group
                i = draw(st.sampled_from(needs))
                ops[col][i] = ""
            else:
                ops[col][i] = draw({
                    "no dot": st.text(min_size=1, max_size=10).filter(lambda g: "." not in g),
                    "bad kind": st.tuples(
                        st.text(max_size=6).filter(lambda k: "." not in k
                                                   and k not in GROUP_KINDS),
                        st.text(max_size=6)).map(".".join),
                    "no id": st.sampled_from(GROUP_KINDS).map(lambda k: k + "."),
                }[choice])
    elif how == "type":
        ops[col][i] = draw(not_a(int))
    elif col == "seq" or draw(st.booleans()):  # any int64 is a valid seq
        # beyond 64 bits: numpy cannot hold it, and the whole ops object says so (issue_ns
        # below -1 is refused first, as its own entry)
        ops[col][i] = draw(ABOVE_I64 if col == "issue_ns" else OUT_OF_I64)
        cause = "$.ops"
    else:  # start_ns, dur_ns, bytes: never negative; issue_ns: -1 at least
        ops[col][i] = draw(st.integers(-(2**63), -2 if col == "issue_ns" else -1))
    return Malformed("bad_op_values", STEPS, t.job.encode(), dumps(m), cause)


@st.composite
def negative_durations(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """A step that ends before it starts, or an op of negative duration or start."""
    m = t.steps
    what = draw(st.sampled_from(["t_end_ns", "t_start_ns", "dur_ns", "start_ns"]))
    d = draw(st.integers(1, 2**62))
    if what == "t_end_ns":
        m["t_end_ns"] = m["t_start_ns"] - d
        cause = "$.t_end_ns"
    elif what == "t_start_ns":
        m["t_start_ns"] = m["t_end_ns"] + d
        cause = "$.t_end_ns"
    else:
        m["ops"][what][draw(st.integers(0, len(m["ops"][what]) - 1))] = -d
        cause = path_cause("ops", what)
    return Malformed("negative_durations", STEPS, t.job.encode(), dumps(m), cause)


@st.composite
def column_lengths(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """One op column (the optional issue_ns too) shorter or longer than the others."""
    m = draw(st.sampled_from(["steps", "gpu_steps"]).map(t.fresh))
    ops = m["ops"]
    n = len(ops["kind"])
    col = draw(st.sampled_from(COLUMNS + ("issue_ns",)))
    values = ops.get(col) or [0] * n
    delta = draw(st.integers(-n, 60).filter(lambda d: d != 0))
    ops[col] = values[:n + delta] if delta < 0 else values + (values * 2)[:delta]
    # the lengths are checked against ops.kind: a kind column of another length shows first
    # on the name column
    cause = "$.ops.name" if col == "kind" else path_cause("ops", col)
    return Malformed("column_lengths", STEPS, t.job.encode(), dumps(m), cause)


@st.composite
def versions(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """Unknown or missing contract versions."""
    topic, m = draw(t.shapes())
    if draw(st.integers(0, 9)) == 0:
        del m["v"]
        cause = "$"  # a missing required field is the object's fault
    else:
        m["v"] = draw(BAD_VERSION)
        cause = "$.v"
    return Malformed("versions", topic, t.job.encode(), dumps(m), cause)


@st.composite
def truncated(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """A valid message cut anywhere (an empty value included)."""
    topic, m = draw(t.shapes())
    raw = dumps(m)
    return Malformed("truncated", topic, t.job.encode(),
                     raw[:draw(st.integers(0, len(raw) - 1))], "$")


def _renamed(draw: st.DrawFn, key: str, taken: Iterable[str]) -> str:
    new = draw(st.one_of(st.text("_xyzQ", min_size=1, max_size=3).map(lambda s: key + s),
                         st.just(key.upper()), st.just(key[:-1]), st.just(key[::-1])))
    return new if new not in set(taken) else key + "_"


REQUIRED = {STEPS: ("v", "job", "rank", "node", "step", "t_start_ns", "t_end_ns", "ops"),
            HEARTBEATS: ("v", "job", "rank", "node", "ts_ns", "step"),
            JOBS: ("v", "job", "event", "ts_ns")}
ALL_KEYS = set(STEPS_FIELDS) | set(HEARTBEAT_FIELDS) | set(START_FIELDS) | set(COLUMNS) | {
    "issue_ns", "tp", "pp", "dp", "ep", "cp", "group", "name", "seq", "start_ns", "node",
    "switch", "thread", "frames", "training"}


@st.composite
def misspelled_keys(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """A required key spelled wrong (so missing), at the top or in a nested object."""
    topic, m = draw(t.shapes())
    where = draw(st.sampled_from(["top", "nested"]))
    if where == "top" or topic == JOBS and m["event"] == "end":
        keys = REQUIRED[topic] + (("world_size",) if topic == JOBS and m["event"] == "start"
                                  else ())
        key = draw(st.sampled_from(keys))
        m[_renamed(draw, key, ALL_KEYS)] = m.pop(key)
        cause = "$.world_size" if key == "world_size" else "$"  # decode_job's own check
    elif topic == STEPS:
        key = draw(st.sampled_from(COLUMNS))
        m["ops"][_renamed(draw, key, ALL_KEYS)] = m["ops"].pop(key)
        cause = "$.ops"
    elif topic == HEARTBEATS:
        obj, keys, cause = draw(st.sampled_from([
            ("inflight", ("group", "name", "seq", "start_ns"), "$.inflight"),
            ("stacks", ("thread", "frames"), "$.stacks")]))
        items = t.stack_heartbeat[obj]
        item = items[draw(st.integers(0, len(items) - 1))]
        key = draw(st.sampled_from(keys))
        item[_renamed(draw, key, ALL_KEYS)] = item.pop(key)
        m[obj] = items
    else:
        where = draw(st.sampled_from(["nodes", "topology"]))
        nodes = t.start["nodes"]
        node = nodes[draw(st.integers(0, len(nodes) - 1))]
        node[_renamed(draw, "node", ALL_KEYS)] = node.pop("node")
        m[where] = nodes
        cause = path_cause(where)
    return Malformed("misspelled_keys", topic, t.job.encode(), dumps(m), cause)


@st.composite
def kafka_keys(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """A valid message keyed by anything but its job (or by nothing): it could land on a
    partition another worker owns, so it must not reach the job's diagnoser."""
    topic, m = draw(t.shapes())
    key = draw(st.one_of(st.none(), st.just(b""), st.binary(max_size=40),
                         st.text(min_size=1, max_size=20).map(str.encode))
               .filter(lambda k: k != t.job.encode()))
    return Malformed("kafka_keys", topic, key, dumps(m), "$key")


@st.composite
def duplicate_keys(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """A top-level key written twice, one of the two values bad (first or last): a decoder
    that kept only one occurrence would let the bad one through."""
    topic, m = draw(t.shapes())
    # a null world_size is refused after decoding, so a valid one beside it would mask it
    fields = END_FIELDS if topic == JOBS else fields_of(topic, m)
    name, bad = draw(st.sampled_from(sorted(fields.items())))
    extra = dumps({name: draw(bad)})[1:-1]
    raw = dumps(m)
    raw = (b"{" + extra + b"," + raw[1:] if draw(st.booleans())
           else raw[:-1] + b"," + extra + b"}")
    return Malformed("duplicate_keys", topic, t.job.encode(), raw, path_cause(name))


NOT_JSON_NUMBERS = (b"NaN", b"-NaN", b"nan", b"Infinity", b"-Infinity", b"inf", b"0x10",
                    b"01", b"+1", b".5", b"1.", b"-", b"1e", b"--1", b"1_000")
OUT_OF_RANGE_NUMBERS = (b"1e400", b"-1e400", b"1e999", b"-2.5e308")
_HOLE = "\x00hole\x00"
_HOLE_JSON = dumps(_HOLE)


def _numeric_slots(topic: str, m: dict[str, Any]) -> list[tuple[tuple[Any, ...], str]]:
    """(path to a number, its cause) of every numeric field of a message."""
    if topic == STEPS:
        top = [((k,), path_cause(k)) for k in ("rank", "step", "t_start_ns", "t_end_ns",
                                                "local_rank")]
        cols = [(("ops", c, i), path_cause("ops", c)) for c in ("seq", "start_ns", "dur_ns",
                                                                  "bytes")
                for i in range(len(m["ops"]["kind"]))]
        return top + cols
    if topic == HEARTBEATS:
        return [((k,), path_cause(k)) for k in ("rank", "step", "ts_ns")] + [
            (("inflight", i, k), path_cause("inflight", k))
            for i in range(len(m["inflight"])) for k in ("seq", "start_ns")]
    return [(("ts_ns",), "$.ts_ns")] + ([(("world_size",), "$.world_size")]
                                         if "world_size" in m else [])


def _put(m: Any, path: tuple[Any, ...], value: Any) -> None:
    for p in path[:-1]:
        m = m[p]
    m[path[-1]] = value


@st.composite
def nan_and_overflow(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """A number that JSON does not have (NaN, Infinity, hex, ...) or that no float holds."""
    topic, m = draw(t.shapes())
    path, cause = draw(st.sampled_from(_numeric_slots(topic, m)))
    _put(m, path, _HOLE)
    if draw(st.integers(0, 3)) == 0:
        token, cause = draw(st.sampled_from(OUT_OF_RANGE_NUMBERS)), cause
    else:
        token, cause = draw(st.sampled_from(NOT_JSON_NUMBERS)), "$"
    raw = dumps(m).replace(_HOLE_JSON, token)
    return Malformed("nan_and_overflow", topic, t.job.encode(), raw, cause)


def _string_slots(topic: str, m: dict[str, Any]) -> list[tuple[Any, ...]]:
    if topic == STEPS:
        n = len(m["ops"]["kind"])
        return [("job",), ("node",)] + [("ops", c, i) for c in ("kind", "name", "group")
                                        for i in range(n)]
    if topic == HEARTBEATS:
        return [("job",), ("node",)] + [("inflight", i, k) for i in range(len(m["inflight"]))
                                        for k in ("group", "name")]
    return [("job",), ("event",)] + [("nodes", i, "node") for i in range(len(m.get("nodes")
                                                                             or []))]


# printable ASCII (no quote, no backslash: the string stays one JSON string), then a byte
# that starts no UTF-8 sequence (a lone continuation byte, an overlong lead, beyond U+10FFFF)
_ASCII = st.sampled_from([bytes([c]) for c in range(0x20, 0x7F) if c not in b'"\\'])
_NEVER_UTF8 = st.sampled_from([bytes([c]) for c in [*range(0x80, 0xC2), *range(0xF5, 0x100)]])
INVALID_UTF8 = st.tuples(st.lists(_ASCII, max_size=6), _NEVER_UTF8,
                         st.lists(st.one_of(_ASCII, st.integers(0x80, 0xFF).map(
                             lambda c: bytes([c]))), max_size=6)
                         ).map(lambda p: b"".join(p[0]) + p[1] + b"".join(p[2]))


@st.composite
def invalid_utf8(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """A string field whose bytes are not UTF-8."""
    topic, m = draw(t.shapes())
    _put(m, draw(st.sampled_from(_string_slots(topic, m))), _HOLE)
    raw = dumps(m).replace(_HOLE_JSON, b'"' + draw(INVALID_UTF8) + b'"')
    return Malformed("invalid_utf8", topic, t.job.encode(), raw, "$")


@st.composite
def garbage(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """Not a JSON object: random bytes, or a JSON value of another type; or no value at all
    (a tombstone)."""
    topic = draw(st.sampled_from(INPUT_TOPICS))
    what = draw(st.sampled_from(["bytes", "json", "none"]))
    value: bytes | None
    if what == "bytes":
        value = draw(st.binary(max_size=200).filter(lambda b: b[:1] not in b"{ \t\r\n"))
    elif what == "json":
        value = dumps(draw(not_a(dict)))
    else:
        value = None
    return Malformed("garbage", topic, t.job.encode(), value, "$")


@st.composite
def wrong_topic(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """A valid message of one topic (of any valid rank or time) published on another."""
    topic, m = draw(t.shapes())
    if "rank" in m:
        m["rank"] = draw(st.integers(0, MAX_RANKS - 1))
    else:
        m["ts_ns"] = draw(st.integers(0, I64_MAX))
    other = draw(st.sampled_from([x for x in INPUT_TOPICS if x != topic]))
    return Malformed("wrong_topic", other, t.job.encode(), dumps(m), "$")


@st.composite
def binary_steps(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """`flare.steps.v2` messages broken where the worker must look: cut anywhere, another
    magic, head fields out of range, codes outside their tables, a group of no kind, a
    collective without a group, negative ops, columns of other lengths."""
    m = t.steps
    ops = m["ops"]
    n = len(ops["kind"])
    i = draw(st.integers(0, n - 1))
    what = draw(st.sampled_from(["cut", "magic", "rank", "step", "local_rank", "t_end_ns",
                                 "kind", "group", "group_name", "no_group", "dur_ns",
                                 "start_ns", "bytes", "length"]))
    if what == "cut":
        raw = encode_steps_value(m)
        cut = draw(st.integers(0, len(raw) - 1))
        n_head = V2_HEAD.unpack_from(raw)[1]
        inside = V2_HEAD.size <= cut < V2_HEAD.size + n_head
        return Malformed("binary_steps", STEPS_V2, t.job.encode(), raw[:cut],
                         "$.header" if inside else "$")
    if what == "magic":
        raw = encode_steps_value(m)
        return Malformed("binary_steps", STEPS_V2, t.job.encode(),
                         draw(st.binary(min_size=4, max_size=4).filter(lambda b: b != b"FLS2"))
                         + raw[4:], "$")
    if what in ("rank", "step", "local_rank", "t_end_ns"):
        bad = {"rank": draw(st.one_of(st.integers(-(2**31), -1),
                                      st.integers(MAX_RANKS, 2**31 - 1))),
               "step": draw(st.integers(-(2**63), -1)),
               "local_rank": draw(st.integers(-(2**31), -1)),
               "t_end_ns": m["t_start_ns"] - draw(st.integers(1, 2**40))}[what]
        return Malformed("binary_steps", STEPS_V2, t.job.encode(), encode_steps_v2(
            **_v2_fields(m, **{what: bad})), f"$.{what}")
    if what == "kind":
        kinds = np.array([KIND_CODE[k] for k in ops["kind"]])
        kinds[i] = draw(st.integers(3, 255))
        return Malformed("binary_steps", STEPS_V2, t.job.encode(), encode_steps_v2(
            **_v2_fields(m, kind=kinds)), "$.ops.kind")
    if what in ("group", "group_name", "no_group"):
        colls = [j for j, k in enumerate(ops["kind"]) if k != "compute"]
        j = draw(st.sampled_from(colls))
        groups = list(ops["group"])
        groups[j] = {"group": draw(st.sampled_from(["", "tp", "xx.1", ".1", "dp."])),
                     "group_name": draw(st.sampled_from(["tp", "xx.1", ".1", "dp."])),
                     "no_group": ""}[what]
        cause = "$.ops.group" if groups[j] == "" else "$.header.groups"
        return Malformed("binary_steps", STEPS_V2, t.job.encode(), encode_steps_v2(
            **_v2_fields(m, group=groups)), cause)
    if what in ("dur_ns", "start_ns", "bytes"):
        col = list(ops[what])
        col[i] = -draw(st.integers(1, 2**40))
        return Malformed("binary_steps", STEPS_V2, t.job.encode(), encode_steps_v2(
            **_v2_fields(m, **{what: col})), path_cause("ops", what))
    field = draw(st.sampled_from(["name", "group", "seq", "start_ns", "dur_ns", "bytes"]))
    col = list(ops[field])
    col = col[:-1] if draw(st.booleans()) else col + col[-1:]
    return Malformed("binary_steps", STEPS_V2, t.job.encode(), encode_steps_v2(
        **_v2_fields(m, **{field: col})), path_cause("ops", field))


def _v2_fields(m: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """`encode_steps_v2`'s arguments for the v1 object `m`, some of them changed."""
    ops = m["ops"]
    fields = {k: m[k] for k in ("job", "rank", "node", "step", "t_start_ns", "t_end_ns")}
    fields.update({k: ops[k] for k in ("kind", "name", "group", "seq", "start_ns", "dur_ns",
                                       "bytes")})
    fields.update(local_rank=m.get("local_rank", 0), coords=m.get("coords"))
    return {**fields, **changes}


def _sized(raw: bytes, cause: str, max_bytes: int) -> str:
    return "$" if len(raw) > max_bytes else cause


@st.composite
def huge_arrays(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """Arrays of tens of thousands of entries with one flaw at the end (or too big)."""
    what = draw(st.sampled_from(["ops", "inflight", "stacks", "nodes"]))
    if what == "ops":
        m = t.steps
        n = draw(st.integers(20_000, 160_000))
        reps = n // len(m["ops"]["kind"]) + 1
        m["ops"] = {c: (v * reps)[:n] for c, v in m["ops"].items()}
        col = draw(st.sampled_from(COLUMNS))
        m["ops"][col] = m["ops"][col][:-1]
        topic, cause = STEPS, "$.ops.name" if col == "kind" else path_cause("ops", col)
    elif what == "inflight":
        m = t.heartbeat
        n = draw(st.integers(10_000, 100_000))
        m["inflight"] = m["inflight"] * n + [{**m["inflight"][0], "seq": "last"}]
        topic, cause = HEARTBEATS, "$.inflight.seq"
    elif what == "stacks":
        m = t.stack_heartbeat
        m["stacks"] = m["stacks"] * draw(st.integers(65, 10_000))  # > 128 threads
        topic, cause = HEARTBEATS, "$.stacks"
    else:
        m = t.start
        n = draw(st.integers(10_000, 100_000))
        m["nodes"] = m["nodes"] * n + [{"node": ""}]
        topic, cause = JOBS, "$.nodes.node"
    raw = dumps(m)
    return Malformed("huge_arrays", topic, t.job.encode(), raw, _sized(raw, cause, max_bytes))


@st.composite
def ten_mb_values(draw: st.DrawFn, t: Templates, max_bytes: int) -> Malformed:
    """One string of 10 MB in a field of any message: over the worker's size limit."""
    assert max_bytes < TEN_MB, "the worker under test must refuse messages of 10 MB"
    topic, m = draw(t.shapes())
    _put(m, draw(st.sampled_from(_string_slots(topic, m))), "x" * draw(
        st.integers(TEN_MB, TEN_MB + 4096)))
    raw = dumps(m)
    return Malformed("ten_mb_values", topic, t.job.encode(), raw, "$")


@dataclass(frozen=True, slots=True)
class FamilySpec:
    name: str
    strategy: Family
    quota: int  # messages in the unit test
    per_example: int = 4  # messages a hypothesis example draws


FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("wrong_types", wrong_types, 1800),
    FamilySpec("bad_op_values", bad_op_values, 1800),
    FamilySpec("negative_durations", negative_durations, 400),
    FamilySpec("column_lengths", column_lengths, 1000),
    FamilySpec("versions", versions, 500),
    FamilySpec("truncated", truncated, 1200),
    FamilySpec("misspelled_keys", misspelled_keys, 800),
    FamilySpec("kafka_keys", kafka_keys, 500),
    FamilySpec("duplicate_keys", duplicate_keys, 500),
    FamilySpec("nan_and_overflow", nan_and_overflow, 700),
    FamilySpec("invalid_utf8", invalid_utf8, 400),
    FamilySpec("garbage", garbage, 500),
    FamilySpec("wrong_topic", wrong_topic, 148),
    FamilySpec("binary_steps", binary_steps, 1000),
    FamilySpec("huge_arrays", huge_arrays, 12, per_example=1),
    FamilySpec("ten_mb_values", ten_mb_values, 6, per_example=1),
)


def draw_cases(spec: FamilySpec, t: Templates, n: int, max_bytes: int,
               check: Callable[[Malformed], None] = lambda _c: None) -> list[Malformed]:
    """`n` messages of a family, the same ones on every run (derandomized, no database),
    each passed to `check` as it is drawn (a failing check is shrunk by hypothesis).

    A hypothesis example draws `spec.per_example` messages: the engine's own cost per
    example was most of the time with one."""
    k = min(spec.per_example, n)
    drawn: list[Malformed] = []

    @settings(max_examples=-(-n // k), derandomize=True, database=None, deadline=None,
              phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck))
    @given(st.lists(spec.strategy(t, max_bytes), min_size=k, max_size=k))
    def run(cases: list[Malformed]) -> None:
        for case in cases:
            check(case)
        drawn.extend(cases)

    run()
    return drawn[:n]


# ---- what the worker must do with them ------------------------------------------------------

_INDEX = re.compile(r"\[\d+\]")


def cause_in(reason: str) -> str:
    """The counter label a dead-letter reason stands for: its field path, indexes removed."""
    return _INDEX.sub("", reason.split(": ", 1)[0])


def check_alone(t: Templates, max_bytes: int) -> Callable[[Malformed], None]:
    """The check of one message through the router of a worker that has already seen the
    job's ranks (the steps decoder's cache is warm, as in a live worker)."""
    warm = dumps(t.steps)
    warm_v2 = encode_steps_value(t.steps)

    def check(case: Malformed) -> None:
        router = JobRouter(JobDiagnoser, max_message_bytes=max_bytes, now_ns=lambda: 0)
        router.steps_decoder.decode(warm)
        router.steps_decoder.decode_v2(warm_v2)
        got = router.decode(case.topic, 0, 7, case.key, case.value)
        assert isinstance(got, Routed) and got.dead_letter is not None, case
        reason = got.dead_letter.reason
        assert cause_in(reason) == case.cause, (reason, case)
        assert router.dead_letters.by_cause == {case.cause: 1}, case
        assert router.jobs() == [], "a dead-lettered message made no diagnoser"
        if case.topic == STEPS and case.value is not None and case.cause != "$key":
            with pytest.raises(InvalidMessage) as plain:  # the cached decoder agrees exactly
                decode_steps(case.value, max_bytes)
            assert reason.startswith(f"{plain.value.field}: {plain.value.reason}"), case
        if case.topic == STEPS_V2 and case.value is not None and case.cause != "$key":
            with pytest.raises(InvalidMessage) as plain:  # the cached decoder agrees exactly
                decode_steps_v2(case.value, max_bytes)
            assert reason.startswith(f"{plain.value.field}: {plain.value.reason}"), case

    return check


@dataclass(slots=True)
class Run:
    """What the worker's pipeline made of one stream."""

    pipeline: Pipeline
    sink: MemoryStore
    incidents: dict[str, IncidentV1] = field(default_factory=dict)  # final state per id
    dead_letters: list[DeadLetterV1] = field(default_factory=list)  # as published

    @property
    def reports(self) -> list[StepReport]:
        return [r for r in self.sink.stored if isinstance(r, StepReport)]

    @property
    def stored_dead_letters(self) -> list[DeadLetterV1]:
        return [r for r in self.sink.stored if isinstance(r, DeadLetterV1)]


def run_pipeline(stream: list[tuple[str, bytes | None, bytes | None]], max_bytes: int,
                 batch: int = 400) -> tuple[Run, list[tuple[str, int]]]:
    """Feed (topic, key, value) records, in order, to a worker pipeline on partition 0, in
    batches; then let a minute pass twice (a job's end is final after a grace). Returns the
    run and each record's (topic, offset)."""
    sink, clock = MemoryStore(), FakeClock()
    pipe = build_pipeline(sink, JobDiagnoser, max_message_bytes=max_bytes, stall_after_s=30.0,
                          job_idle_s=3600.0, now_s=clock.seconds)
    offsets: Counter[str] = Counter()
    records: list[Record] = []
    for topic, key, value in stream:
        records.append(Record(topic, 0, offsets[topic], key, value))
        offsets[topic] += 1
    pipe.on_assigned([(t, 0) for t in INPUT_TOPICS])
    for topic in INPUT_TOPICS:
        pipe.progress.set_highwater(topic, 0, offsets[topic])
    run = Run(pipe, sink)
    outgoing = []
    for i in range(0, len(records), batch):
        outgoing += pipe.on_records(records[i:i + batch]).outgoing
        assert pipe.flush()
    for _ in range(2):
        outgoing += [o for part in pipe.ticks() for o in part.outgoing]
        assert pipe.flush()
        clock.advance(60)
    for o in outgoing:
        if o.topic == INCIDENTS:
            inc = msgspec.json.decode(o.value, type=IncidentV1)
            run.incidents[inc.id] = inc
        elif o.topic == DEADLETTER:
            run.dead_letters.append(msgspec.json.decode(o.value, type=DeadLetterV1))
    return run, [(r.topic, r.offset) for r in records]


def interleave(good: list[tuple[str, bytes]], bad: list[Malformed], job: str
               ) -> tuple[list[tuple[str, bytes | None, bytes | None]], list[int]]:
    """The good messages with the bad ones spread evenly among them; returns the stream and
    the positions of the bad ones in it."""
    stream: list[tuple[str, bytes | None, bytes | None]] = []
    where: list[int] = []
    b = 0
    for i, (topic, value) in enumerate(good):
        while b < len(bad) and b * len(good) <= i * len(bad):
            where.append(len(stream))
            stream.append((bad[b].topic, bad[b].key, bad[b].value))
            b += 1
        stream.append((topic, job.encode(), value))
    for case in bad[b:]:
        where.append(len(stream))
        stream.append((case.topic, case.key, case.value))
    return stream, where


def metric_samples(text: str, name: str) -> dict[str, float]:
    """`name{<label>="x"} v` samples of a Prometheus page, by the label's value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.fullmatch(rf'{name}\{{\w+="((?:[^"\\]|\\.)*)"\}} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def expected_payload(value: bytes | None) -> bytes:
    return (value or b"")[:MAX_PAYLOAD_BYTES]


# ---- the tests ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tpl() -> Templates:
    return templates(JOB)


@pytest.fixture(scope="module")
def good() -> list[tuple[str, bytes]]:
    return good_messages(JOB)


@pytest.fixture(scope="module")
def clean(good: list[tuple[str, bytes]]) -> Run:
    run, _ = run_pipeline([(t, JOB.encode(), v) for t, v in good], DEFAULT_MAX_BYTES)
    assert run.incidents and {i.culprit for i in run.incidents.values()} == {"rank:7"}
    assert run.dead_letters == [] and len(run.reports) == 30
    return run


def test_the_families_add_up_to_ten_thousand_messages_and_cover_every_input_topic(
        tpl: Templates) -> None:
    assert sum(f.quota for f in FAMILIES) >= 10_000
    topics = {c.topic for f in FAMILIES if f.per_example > 1  # not the 10 MB ones
              for c in draw_cases(f, tpl, 8, DEFAULT_MAX_BYTES)}
    assert topics == set(INPUT_TOPICS)


@pytest.mark.parametrize("spec", FAMILIES, ids=[f.name for f in FAMILIES])
def test_malformed_messages_are_dead_lettered_once_and_change_no_diagnosis(
        spec: FamilySpec, tpl: Templates, good: list[tuple[str, bytes]], clean: Run) -> None:
    cases = draw_cases(spec, tpl, spec.quota, DEFAULT_MAX_BYTES,
                       check_alone(tpl, DEFAULT_MAX_BYTES))
    assert len(cases) == spec.quota, "hypothesis ran out of distinct examples"

    stream, where = interleave(good, cases, JOB)
    run, coords = run_pipeline(stream, DEFAULT_MAX_BYTES)

    # the good messages: the same diagnosis, the same steps stored
    assert run.incidents == clean.incidents
    assert len(run.reports) == len(clean.reports)
    # the bad ones: one dead letter each, where it was, with its bytes (cut when huge)
    want = {coords[i]: c for i, c in zip(where, cases, strict=True)}
    for dls in (run.dead_letters, run.stored_dead_letters):
        assert len(dls) == len(cases)
        assert {(d.topic, d.offset) for d in dls} == set(want)
    for d in run.dead_letters:
        case = want[(d.topic, d.offset)]
        assert cause_in(d.reason) == case.cause, (d.reason, case)
        assert base64.b64decode(d.payload_b64) == expected_payload(case.value)
    # the counters: exact, by cause and by topic, in the snapshot and on the metrics page
    causes = Counter(c.cause for c in cases)
    counts = run.pipeline.router.dead_letters
    assert counts.total == len(cases)
    assert counts.by_cause == causes
    assert counts.by_topic == Counter(c.topic for c in cases)
    page = run.pipeline.metrics_text()
    assert metric_samples(page, "flare_worker_dead_letters_total") == causes
    assert metric_samples(page, "flare_worker_messages_total") == Counter(t for t, _k, _v in stream)


def test_a_decoder_bug_costs_one_dead_letter_not_the_batch_around_it(
        monkeypatch: pytest.MonkeyPatch, good: list[tuple[str, bytes]], clean: Run) -> None:
    """An exception a decoder was never meant to raise (as msgspec's UnicodeDecodeError
    was) is the message's dead letter, under `internal`; the records around it go on."""
    import streams.routing

    real = streams.routing.decode_heartbeat

    def buggy(raw: bytes, max_bytes: int) -> Any:
        if b"boom" in raw:
            raise KeyError("boom")
        return real(raw, max_bytes)

    monkeypatch.setattr(streams.routing, "decode_heartbeat", buggy)
    stream = [(t, JOB.encode(), v) for t, v in good]
    stream.insert(len(stream) // 2, (HEARTBEATS, JOB.encode(), b'{"boom": 1}'))
    run, _ = run_pipeline(stream, DEFAULT_MAX_BYTES)
    assert run.incidents == clean.incidents and len(run.reports) == len(clean.reports)
    assert [cause_in(d.reason) for d in run.dead_letters] == ["internal"]
    assert "KeyError" in run.dead_letters[0].reason
    assert run.pipeline.router.dead_letters.by_cause == {"internal": 1}
