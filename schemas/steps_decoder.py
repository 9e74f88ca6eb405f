"""`StepsDecoder`: `decode_steps` for the worker's hot path, cheaper and with the same answers.

WHY: at 8,192 GPUs a worker decodes ~780 rank-step messages of ~830 ops per second. The
plain `decode_steps` spends ~320 µs on one: msgspec builds ~5,800 Python objects (3 strings
and 4 ints per op), then numpy converts the lists and Python checks every group. Two facts
make most of that avoidable (~125 µs per message once a rank is cached; see
load-tests/bench_decode.py):

- a rank's `kind`, `name` and `group` columns repeat exactly from step to step, so their
  JSON text is compared (memcmp) with the text seen last time for that (job, rank), and
  what it decoded to is reused: validation, kind codes, the strings themselves;
- the four int columns are plain JSON integer arrays, which numpy parses straight from the
  text (`np.fromstring`), several times faster than Python ints then `np.array`.

Those columns are therefore taken from the message as raw JSON text (`msgspec.Raw`), and
this module must prove by itself what msgspec would have checked. It returns a result only
when it has proved the message valid and equal to what `decode_steps` returns; on any doubt
it calls `decode_steps`, which accepts or rejects exactly as it always did (so the accepted
set and every `InvalidMessage` are unchanged by construction). Doubts are cheap to detect:

- a key written twice would let a bad first value slip past a raw field (msgspec validates
  every occurrence of a typed field, keeps the last of a raw one): every key is followed by
  exactly one ':', so the message's colons must equal the keys it must have plus the colons
  inside its known strings; a duplicate or unknown key, or any surprise, breaks the count;
- an int column must hold JSON integer literals only (msgspec already checked the grammar,
  so the absence of a few bytes proves it), and parse to exactly n values per column: the
  columns are parsed as one text with sentinels (INT64_MIN) between them; numpy turns an
  out-of-range value into INT64_MAX (tests pin this), so either extreme sends the message
  to the plain path, which reports an overflow exactly as before.
- the optional `issue_ns` column (GPU-side timing, additive in v1) is `null` or an integer
  column like the others, proved the same way on its own (n values, none below -1, none at
  the extremes); its key adds one colon. It is validated, not carried: `RankStep` has no
  field for it yet.

Memory stays bounded: columns are shared by content (the ranks of one pipeline stage send the
same kinds and names), entries are dropped by `forget(job)` when a job goes away and by an
LRU cap (~13.5 KB per cached rank of 830 ops, while each decoded RankStep shares its strings
instead of owning ~70 KB of them). Keep `max_ranks` at or above the ranks a worker serves:
LRU over ranks that report round-robin keeps nothing once they outnumber it (still correct,
only slower).
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from typing import Literal

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from schemas.decode import DEFAULT_MAX_BYTES, _check_size, _group_ok, decode_steps
from schemas.rankstep import KIND_CODE, RankStep
from schemas.steps_v2 import OpCodes, decode_steps_v2, op_codes
from schemas.wire import Int64, Name, NonNeg, OpKind, Rank

_I64_MIN = int(np.iinfo(np.int64).min)
_I64_MAX = int(np.iinfo(np.int64).max)
_SENTINEL = b",%d," % _I64_MIN
# msgspec has checked the JSON grammar, so a value of an int column that is not an integer
# literal starts with one of '"tfn[{' (string, true, false, null, array, object) or is a
# number with one of '.eE' (a float): text without any of these holds integers only.
_NOT_INT = tuple(bytes([c]) for c in b'.eE"tfn[{')
_COLON = 58
# what msgspec raises on bytes it cannot decode: a string that is not UTF-8 is a
# UnicodeDecodeError, not a DecodeError; either sends the message to `decode_steps`
_UNDECODABLE = (msgspec.DecodeError, UnicodeDecodeError)
_COORD_DIMS = ("tp", "pp", "dp", "ep", "cp")
_REQUIRED_KEYS = 15  # v job rank node step t_start_ns t_end_ns ops + the 7 op columns


class _RawOps(msgspec.Struct):
    kind: msgspec.Raw
    name: msgspec.Raw
    group: msgspec.Raw
    seq: msgspec.Raw
    start_ns: msgspec.Raw
    dur_ns: msgspec.Raw
    bytes: msgspec.Raw
    issue_ns: msgspec.Raw | UnsetType = UNSET


class _SeenCoords(msgspec.Struct, forbid_unknown_fields=False):
    """`wire.Coords` with UNSET for an absent key, so the keys present can be counted."""

    tp: NonNeg | None | UnsetType = UNSET
    pp: NonNeg | None | UnsetType = UNSET
    dp: NonNeg | None | UnsetType = UNSET
    ep: NonNeg | None | UnsetType = UNSET
    cp: NonNeg | None | UnsetType = UNSET


class _RawSteps(msgspec.Struct):
    """`wire.StepsV1` with the op columns left as JSON text and absent keys told apart."""

    v: Literal[1]
    job: Name
    rank: Rank
    node: Name
    step: NonNeg
    t_start_ns: Int64
    t_end_ns: Int64
    ops: _RawOps
    local_rank: NonNeg | UnsetType = UNSET
    coords: _SeenCoords | None | UnsetType = UNSET


_raw_steps = msgspec.json.Decoder(_RawSteps)
_kinds = msgspec.json.Decoder(list[OpKind])
_strings = msgspec.json.Decoder(list[str])


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


_NO_CODES = _frozen(np.zeros(0, dtype=np.uint8))


class _Column:
    """One distinct column text and what it decodes to; shared by every rank that sends it."""

    __slots__ = ("__weakref__", "codes", "colons", "raw", "values")

    def __init__(self, raw: bytes, values: tuple[str, ...], codes: np.ndarray = _NO_CODES) -> None:
        self.raw = raw
        self.values = values
        self.codes = codes  # kind: uint8 codes; group: has-a-group mask (read-only)
        self.colons = raw.count(b":")


class _Entry:
    """The last validated kind/name/group columns of one rank (valid together)."""

    __slots__ = ("group", "kind", "name")

    def __init__(self, kind: _Column, name: _Column, group: _Column) -> None:
        self.kind, self.name, self.group = kind, name, group


def _kind_column(raw: bytes) -> _Column | None:
    try:
        kinds = _kinds.decode(raw)
    except _UNDECODABLE:
        return None
    codes = np.fromiter((KIND_CODE[k] for k in kinds), dtype=np.uint8, count=len(kinds))
    return _Column(raw, tuple(map(sys.intern, kinds)), _frozen(codes))


def _name_column(raw: bytes) -> _Column | None:
    try:
        names = _strings.decode(raw)
    except _UNDECODABLE:
        return None
    return _Column(raw, tuple(map(sys.intern, names)))


def _group_column(raw: bytes) -> _Column | None:
    try:
        groups = _strings.decode(raw)
    except _UNDECODABLE:
        return None
    if not all(_group_ok(g) for g in set(groups) if g):
        return None
    has = np.fromiter((g != "" for g in groups), dtype=bool, count=len(groups))
    return _Column(raw, tuple(map(sys.intern, groups)), _frozen(has))


def _int_columns(ops: _RawOps, n: int) -> tuple[np.ndarray, ...] | None:
    """start_ns, dur_ns, bytes, seq as int64 (views of one array), or None if in doubt."""
    parts = []
    for r in (ops.start_ns, ops.dur_ns, ops.bytes, ops.seq):
        col = bytes(r)
        if col[:1] != b"[" or col[-1:] != b"]":
            return None
        inner = col[1:-1]
        if not inner.strip():  # an empty column, and n >= 1
            return None
        parts.append(inner)
    text = _SENTINEL.join(parts)
    for ch in _NOT_INT:  # a memchr each: ~3x cheaper than a bytes.translate whitelist
        if ch in text:
            return None
    try:
        vals = np.fromstring(text, dtype=np.int64, sep=",")
    except (ValueError, OverflowError):
        return None
    a, b, c = n, 2 * n + 1, 3 * n + 2  # where the sentinels must be
    if vals.size != 4 * n + 3 or vals[a] != _I64_MIN or vals[b] != _I64_MIN:
        return None
    if vals[c] != _I64_MIN or np.count_nonzero(vals == _I64_MIN) != 3:
        return None  # so each column has exactly n values, none of them INT64_MIN
    if int(vals.max()) == _I64_MAX:  # out of range (numpy saturates) or the extreme itself
        return None
    if np.count_nonzero(vals[:c] < 0) != 2:  # a negative start, duration or size
        return None
    return vals[:a], vals[a + 1 : b], vals[b + 1 : c], vals[c + 1 :]


def _issue_ok(raw: msgspec.Raw | UnsetType, n: int) -> bool:
    """Whether the optional issue_ns column is absent, null, or n integers >= -1 (in int64)."""
    if raw is UNSET:
        return True
    col = bytes(raw)
    if col == b"null":
        return True
    if col[:1] != b"[" or col[-1:] != b"]" or not col[1:-1].strip():
        return False
    inner = col[1:-1]
    for ch in _NOT_INT:
        if ch in inner:
            return False
    try:
        vals = np.fromstring(inner, dtype=np.int64, sep=",")
    except (ValueError, OverflowError):
        return False
    # numpy saturates out-of-range values to an extreme: INT64_MAX is refused here, and the
    # lower one by the minimum
    return vals.size == n and int(vals.min()) >= -1 and int(vals.max()) != _I64_MAX


def _expected_colons(m: _RawSteps, entry: _Entry, raw: bytes) -> int:
    """Colons the message has if every key appears once and no unknown key is present."""
    n = _REQUIRED_KEYS + entry.kind.colons + entry.name.colons + entry.group.colons
    if b"\\" not in raw:  # job and node are then their own JSON text
        n += m.job.count(":") + m.node.count(":")
    if m.local_rank is not UNSET:
        n += 1
    if m.ops.issue_ns is not UNSET:
        n += 1
    c = m.coords
    if c is not UNSET:
        n += 1
        if c is not None:
            n += sum(getattr(c, d) is not UNSET for d in _COORD_DIMS)
    return n


class StepsDecoder:
    """Decodes `flare.steps.v1` like `decode_steps`, caching per (job, rank) what repeats.

    Owned by one consumer (the worker's router, an offline run); not shared across threads.
    The returned `kind` array (read-only) and the `name` and `group` tuples are shared between
    the messages of a rank: a list per message was two 830-element copies, and thousands of
    pending lists made every full garbage collection walk millions of pointers (tuples of
    strings are untracked by the collector). The int columns are the message's own.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_ranks: int = 16_384) -> None:
        self.max_bytes = max_bytes
        self.max_ranks = max_ranks
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._columns: weakref.WeakValueDictionary[tuple[int, bytes], _Column] = (
            weakref.WeakValueDictionary()
        )
        # v2 messages: their decoded kind, name and group columns by the columns' bytes and
        # tables, least recently used first
        self._v2_ops: OrderedDict[tuple[object, ...], OpCodes] = OrderedDict()
        self.hits = 0  # messages whose kind/name/group matched the rank's last ones
        self.misses = 0
        self.fallbacks = 0  # messages decoded by `decode_steps` (invalid, or unusual)

    def __len__(self) -> int:
        return len(self._entries)

    def forget(self, *jobs: str) -> int:
        """Drop the entries of jobs that went away (one pass); returns how many were dropped."""
        gone = set(jobs)
        keys = [k for k in self._entries if k[0] in gone]
        for k in keys:
            del self._entries[k]
        return len(keys)

    def decode(self, raw: bytes) -> RankStep:
        """Decode and validate one message; raises `InvalidMessage` exactly as `decode_steps`."""
        _check_size(raw, self.max_bytes)
        step = self._fast(raw) if type(raw) is bytes else None
        if step is None:
            self.fallbacks += 1
            return decode_steps(raw, self.max_bytes)
        return step

    def decode_v2(self, raw: bytes) -> RankStep:
        """Decode and validate one `flare.steps.v2` message (`decode_steps_v2`). A rank's
        kind, name and group columns repeat from step to step: what they decoded to (checked,
        the kind codes, the name and group tuples) is kept and shared, as v1's are."""
        return decode_steps_v2(raw, self.max_bytes, coder=self._op_codes_v2)

    def _op_codes_v2(self, kind: np.ndarray, name: np.ndarray, group: np.ndarray,
                     names: list[str], groups: list[str]) -> OpCodes:
        # the bytes with their dtypes: the same bytes read as another type are other codes
        key = (kind.size, kind.dtype.str, name.dtype.str, group.dtype.str, kind.tobytes(),
               name.tobytes(), group.tobytes(), tuple(names), tuple(groups))
        cache = self._v2_ops
        got = cache.get(key)
        if got is not None:
            cache.move_to_end(key)
            self.hits += 1
            return got
        self.misses += 1
        got = cache[key] = op_codes(kind, name, group, names, groups)  # raises when invalid
        if len(cache) > self.max_ranks:
            cache.popitem(last=False)
        return got

    def _column(self, slot: int, raw: bytes) -> _Column | None:
        col = self._columns.get((slot, raw))
        if col is None:
            col = (_kind_column, _name_column, _group_column)[slot](raw)
            if col is not None:
                self._columns[(slot, raw)] = col
        return col

    def _entry(self, job: str, rank: int, ops: _RawOps) -> _Entry | None:
        key = (job, rank)
        kr, nr, gr = bytes(ops.kind), bytes(ops.name), bytes(ops.group)
        e = self._entries.get(key)
        if e is not None and e.kind.raw == kr and e.group.raw == gr and e.name.raw == nr:
            self._entries.move_to_end(key)
            self.hits += 1
            return e
        self.misses += 1
        kind, name, group = self._column(0, kr), self._column(1, nr), self._column(2, gr)
        if kind is None or name is None or group is None:
            return None
        n = len(kind.values)
        if len(name.values) != n or len(group.values) != n:
            return None
        if ((kind.codes != 0) & ~group.codes).any():  # a coll or p2p op without a group
            return None
        e = self._entries[key] = _Entry(kind, name, group)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_ranks:
            self._entries.popitem(last=False)
        return e

    def _fast(self, raw: bytes) -> RankStep | None:
        try:
            m = _raw_steps.decode(raw)
        except _UNDECODABLE:
            return None
        if m.t_end_ns < m.t_start_ns:
            return None
        e = self._entry(m.job, m.rank, m.ops)
        if e is None:
            return None
        n = len(e.kind.values)
        if n == 0:  # an empty step: rare, and cheap for the plain path
            return None
        colons = np.count_nonzero(np.frombuffer(raw, dtype=np.uint8) == _COLON)
        if colons != _expected_colons(m, e, raw):
            return None
        ints = _int_columns(m.ops, n)
        if ints is None or not _issue_ok(m.ops.issue_ns, n):
            return None
        start, dur, nbytes, seq = ints
        coords: dict[str, int] = {}
        c = m.coords
        if c is not UNSET and c is not None:
            for d in _COORD_DIMS:
                v = getattr(c, d)
                if v is not None and v is not UNSET:
                    coords[d] = v
        return RankStep(
            job=m.job,
            rank=m.rank,
            node=m.node,
            step=m.step,
            t_start_ns=m.t_start_ns,
            t_end_ns=m.t_end_ns,
            kind=e.kind.codes,
            name=e.name.values,  # shared immutable tuples: no copy, and the GC untracks them
            group=e.group.values,
            seq=seq,
            start_ns=start,
            dur_ns=dur,
            bytes=nbytes,
            local_rank=0 if m.local_rank is UNSET else m.local_rank,
            coords=coords,
        )
