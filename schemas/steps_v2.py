"""`flare.steps.v2`: one rank's step as binary columns with delta-coded starts.

WHY (issue #17, "less on the wire"): a v1 steps message is JSON, 57.5 bytes per op (about
19 once lz4 compresses a producer's batch), and decoding it is a third of a 16,384-GPU
worker's main thread even on the cached path (BENCHMARKS.md). A broker on the worker's
machine holds every byte of a run too. Here an op costs 17–23 bytes (8.5–10 after lz4): its
kind, name and group are codes into string tables sent once per message, its integers are
stored in the narrowest dtype they fit, and its start is its distance from the rank's
previous op. numpy reads each column with one `frombuffer`.

v2 is a new topic, not a new shape of v1 (DESIGN §3: anything incompatible is v2 on a new
topic); the worker reads both, and a producer picks one (`FLARE_STEPS_ENCODING`). Heartbeats
and job events stay v1.

Layout, little-endian:
- the fixed head (40 bytes): the magic `FLS2`, the header's length (uint32), rank and
  local rank (int32 each), step, t_start_ns and t_end_ns (int64 each). A template of a
  message can be re-stamped with another step and times without re-encoding it;
- the header (JSON): the job, the node, the coords when known, the string tables (`names`,
  `groups`), and each column's stored dtype and size;
- 8 columns, each padded to 8 bytes (`schemas.binary_columns`): kind (codes into
  `OP_KINDS`), name and group (codes into the tables), seq, start_ns (the difference from the
  previous op's), dur_ns, bytes, issue_ns (empty: the producer timed nothing on a GPU).

Decoding checks everything `decode_steps` checks of a v1 message, and raises
`InvalidMessage` with the field at fault, so a bad message is dead-lettered with its reason.

>>> import numpy as np
>>> raw = encode_steps_v2(job="j", rank=3, node="n1", step=7, t_start_ns=100, t_end_ns=150,
...     kind=["compute", "coll", "coll"], name=["fwd", "all_reduce", "all_reduce"],
...     group=["", "dp.0", "dp.0"], seq=[0, 12, 13], start_ns=[0, 20, 35],
...     dur_ns=[20, 30, 10], bytes=[0, 4096, 4096], local_rank=1, coords={"dp": 0})
>>> m = decode_steps_v2(raw)
>>> (m.rank, m.step, m.t_end_ns, list(m.name), m.start_ns.tolist(), m.coords)
(3, 7, 150, ['fwd', 'all_reduce', 'all_reduce'], [0, 20, 35], {'dp': 0})
>>> decode_steps_v2(raw[:-5])
Traceback (most recent call last):
...
schemas.errors.InvalidMessage: $: truncated: the columns need ... bytes, the message has ...
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any, NamedTuple

import msgspec
import numpy as np

from schemas.binary_columns import ALIGN, pack_columns, pad, read_columns
from schemas.decode import DEFAULT_MAX_BYTES, _check_size, _group_ok
from schemas.errors import InvalidMessage
from schemas.rankstep import GROUP_KINDS, KIND_CODE, OP_KINDS, RankStep
from schemas.wire import MAX_RANKS, Coords, Name, NonNeg

MAGIC = b"FLS2"
HEAD = struct.Struct("<4sIiiqqq")
# where a template re-stamps a message (`restamp`): the step and the two times
STEP_AT, T_START_AT, T_END_AT = 16, 24, 32
_COLUMNS = ("kind", "name", "group", "seq", "start_ns", "dur_ns", "bytes", "issue_ns")
_COLUMN_FIELDS = tuple(f"ops.{c}" for c in _COLUMNS)
_I64_MAX = 2**63 - 1


class OpCodes(NamedTuple):
    """What a message's kind, name and group columns decode to (validated)."""

    kind: np.ndarray  # uint8 codes into OP_KINDS, read-only (shared by a cache)
    name: Sequence[str]
    group: Sequence[str]


# kind, name and group codes and the two tables -> OpCodes: `op_codes`, or a caching one
# (`StepsDecoder.decode_v2`: a rank's three columns repeat exactly from step to step).
Coder = Callable[[np.ndarray, np.ndarray, np.ndarray, list[str], list[str]], OpCodes]


class _Header(msgspec.Struct, frozen=True):  # unknown keys ignored: additive within v2
    job: Name
    node: Name
    names: list[str]
    groups: list[str]
    dtypes: list[str]  # stored dtype of each column, in `_COLUMNS` order
    sizes: list[NonNeg]  # elements of each column
    coords: Coords | None = None


_encode_header = msgspec.json.Encoder().encode
_decode_header = msgspec.json.Decoder(_Header).decode


def _codes(values: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """Each string's index into the table of distinct strings, in order of first use."""
    table: dict[str, int] = {}
    codes = [table.setdefault(v, len(table)) for v in values]
    return np.array(codes, dtype=np.int64), list(table)


def encode_steps_v2(
    *,
    job: str,
    rank: int,
    node: str,
    step: int,
    t_start_ns: int,
    t_end_ns: int,
    kind: Sequence[str] | np.ndarray,
    name: Sequence[str],
    group: Sequence[str],
    seq: Sequence[int] | np.ndarray,
    start_ns: Sequence[int] | np.ndarray,
    dur_ns: Sequence[int] | np.ndarray,
    bytes: Sequence[int] | np.ndarray,
    local_rank: int = 0,
    coords: Mapping[str, int] | None = None,
    issue_ns: Sequence[int] | np.ndarray | None = None,
) -> bytes:
    """The v2 bytes of one rank's step: the fields of `steps_message`, `kind` as names or as
    codes into `OP_KINDS`. KeyError for a kind that is not one; ValueError or OverflowError
    for a column that is not integers of 64 bits; struct.error for a head field out of its
    range (a producer falls back to v1 on any of them, and the worker says why)."""
    kinds = np.asarray(kind)
    if kinds.dtype.kind not in "iu":
        kinds = np.fromiter((KIND_CODE[k] for k in kind), dtype=np.uint8, count=len(kind))
    names, name_table = _codes(name)
    groups, group_table = _codes(group)
    start = np.asarray(start_ns, dtype=np.int64)
    delta = np.empty_like(start)
    if start.size:
        delta[0] = start[0]
        np.subtract(start[1:], start[:-1], out=delta[1:])
    issue = np.zeros(0, np.int64) if issue_ns is None else np.asarray(issue_ns, dtype=np.int64)
    parts, dtypes, sizes = pack_columns([
        kinds, names, groups, np.asarray(seq, dtype=np.int64), delta,
        np.asarray(dur_ns, dtype=np.int64), np.asarray(bytes, dtype=np.int64), issue])
    header = _encode_header(_Header(
        job=job, node=node, names=name_table, groups=group_table, dtypes=dtypes, sizes=sizes,
        coords=Coords(**coords) if coords else None))
    head = HEAD.pack(MAGIC, len(header), rank, local_rank, step, t_start_ns, t_end_ns)
    return b"".join([head, header, pad(HEAD.size + len(header)), *parts])


def encode_rank_step(m: RankStep) -> bytes:
    """The v2 bytes of a decoded step (what a producer holding a v1 message sends)."""
    return encode_steps_v2(
        job=m.job, rank=m.rank, node=m.node, step=m.step, t_start_ns=m.t_start_ns,
        t_end_ns=m.t_end_ns, kind=m.kind, name=m.name, group=m.group, seq=m.seq,
        start_ns=m.start_ns, dur_ns=m.dur_ns, bytes=m.bytes, local_rank=m.local_rank,
        coords=m.coords)


def encode_steps_value(value: Mapping[str, Any]) -> bytes:
    """The v2 bytes of a v1 steps object (`schemas.steps_message`): what the simulator and
    the replays build."""
    ops = value["ops"]
    return encode_steps_v2(
        job=value["job"], rank=value["rank"], node=value["node"], step=value["step"],
        t_start_ns=value["t_start_ns"], t_end_ns=value["t_end_ns"], kind=ops["kind"],
        name=ops["name"], group=ops["group"], seq=ops["seq"], start_ns=ops["start_ns"],
        dur_ns=ops["dur_ns"], bytes=ops["bytes"], local_rank=value.get("local_rank", 0),
        coords=value.get("coords"), issue_ns=ops.get("issue_ns"))


def restamp(template: bytes | bytearray, *, step: int, t_start_ns: int, t_end_ns: int) -> bytes:
    """The same message at another step and time (benchmarks replay a few steps for long)."""
    out = bytearray(template)
    struct.pack_into("<qqq", out, STEP_AT, step, t_start_ns, t_end_ns)
    return bytes(out)


def decode_steps_v2(raw: bytes, max_bytes: int = DEFAULT_MAX_BYTES,
                    coder: Coder | None = None) -> RankStep:
    """Decode and validate one `flare.steps.v2` message; InvalidMessage says what is wrong.
    `coder` validates and decodes the kind, name and group columns (default `op_codes`)."""
    _check_size(raw, max_bytes)
    if len(raw) < HEAD.size:
        raise InvalidMessage("$", f"{len(raw)} bytes, shorter than a v2 steps message's head")
    magic, n_head, rank, local_rank, step, t_start, t_end = HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise InvalidMessage("$", f"starts with {magic!r}, not a v2 steps message ({MAGIC!r})")
    if not 0 <= rank < MAX_RANKS:
        raise InvalidMessage("$.rank", f"{rank} is outside 0 to {MAX_RANKS - 1}")
    if local_rank < 0:
        raise InvalidMessage("$.local_rank", f"is negative ({local_rank})")
    if step < 0:
        raise InvalidMessage("$.step", f"is negative ({step})")
    if t_end < t_start:
        raise InvalidMessage("$.t_end_ns", "is before t_start_ns")
    try:
        h = _decode_header(raw[HEAD.size:HEAD.size + n_head])
    except msgspec.DecodeError as e:
        raise InvalidMessage("$.header", f"not a v2 steps header: {e}") from None
    except UnicodeDecodeError as e:
        raise InvalidMessage("$.header", f"a string is not valid UTF-8 ({e.reason})") from None
    pos = HEAD.size + n_head
    pos += -pos % ALIGN
    kind, name, group, seq, delta, dur, nbytes, issue = read_columns(
        raw, pos, h.dtypes, h.sizes, _COLUMN_FIELDS)
    n = kind.size
    for field, col in (("name", name), ("group", group), ("seq", seq), ("start_ns", delta),
                       ("dur_ns", dur), ("bytes", nbytes)):
        if col.size != n:
            raise InvalidMessage(f"$.ops.{field}", f"has {col.size} entries but ops.kind has {n}")
    if issue.size not in (0, n):
        raise InvalidMessage("$.ops.issue_ns", f"has {issue.size} entries but ops.kind has {n}")
    ops = (coder or op_codes)(kind, name, group, h.names, h.groups)
    if n and delta.dtype.itemsize == 8 and int(np.abs(delta).max()) > _I64_MAX // (2 * n):
        raise InvalidMessage("$.ops.start_ns", "a start does not fit in 64 bits")
    start = np.cumsum(delta, dtype=np.int64)
    # unsigned columns hold no negative value: only signed ones are looked at
    for field, col, signed in (("dur_ns", dur, dur), ("start_ns", start, delta),
                               ("bytes", nbytes, nbytes)):
        if n and signed.dtype.kind == "i" and int(col.min()) < 0:
            i = int(np.argmin(col))
            raise InvalidMessage(f"$.ops.{field}[{i}]", f"is negative ({int(col[i])})")
    if issue.size and issue.dtype.kind == "i" and int(issue.min()) < -1:
        i = int(np.argmin(issue))
        raise InvalidMessage(f"$.ops.issue_ns[{i}]", f"is below -1 ({int(issue[i])})")
    coords: dict[str, int] = {}
    if h.coords is not None:
        coords = {k: v for k, v in msgspec.structs.asdict(h.coords).items() if v is not None}
    return RankStep(
        job=h.job, rank=rank, node=h.node, step=step, t_start_ns=t_start, t_end_ns=t_end,
        kind=ops.kind, name=ops.name, group=ops.group, seq=seq.astype(np.int64),
        start_ns=start, dur_ns=dur.astype(np.int64), bytes=nbytes.astype(np.int64),
        local_rank=local_rank, coords=coords)


def op_codes(kind: np.ndarray, name: np.ndarray, group: np.ndarray, names: list[str],
             groups: list[str]) -> OpCodes:
    """The kind codes and per-op names and groups, once every code is inside its table,
    every group is '<kind>.<id>', and every collective and transfer has a group."""
    n = kind.size
    for field, col, table in (("kind", kind, OP_KINDS), ("name", name, names),
                              ("group", group, groups)):
        if n and ((col.dtype.kind == "i" and int(col.min()) < 0)
                  or int(col.max()) >= len(table)):
            raise InvalidMessage(f"$.ops.{field}", f"codes outside its table of {len(table)}")
    for i, g in enumerate(groups):
        if g and not _group_ok(g):
            raise InvalidMessage(f"$.header.groups[{i}]", f"{g!r} is not '<kind>.<id>' with "
                                                         f"kind in {sorted(GROUP_KINDS)}")
    kinds = kind.astype(np.uint8)
    if n and "" in groups:
        bad = (kinds != 0) & (group == groups.index(""))
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidMessage(f"$.ops.group[{i}]", "a coll or p2p op needs a group")
    kinds.setflags(write=False)
    return OpCodes(kinds, strings_of(name, names), strings_of(group, groups))


def strings_of(codes: np.ndarray, table: list[str]) -> tuple[str, ...]:
    """The per-op strings of a column of codes (a tuple, as the cached v1 decoder gives)."""
    if codes.size == 0:
        return ()
    if codes.size == 1:
        return (table[int(codes[0])],)
    return itemgetter(*codes.tolist())(table)
