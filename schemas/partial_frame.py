"""A shard's step on the wire between the two stages: binary columns, delta-coded integers.

Past one worker for one job (issue #17), stage 1 assembles the ranks of one shard of a job
into a `StepFrame` of their own, and stage 2 merges the shards' frames into the job's step.
What crosses Kafka between them is this encoding, not JSON: stage 2 sits on the job's one
partition, so every microsecond it spends per op is the whole job's ceiling, and numpy reads
these columns with one `frombuffer` each where JSON costs ~0.13 µs per op
(BENCHMARKS.md, "Two stages").

Layout: the magic `FLP1`, the header's length (uint32, little-endian), the header (JSON:
the job, step, shard, the string tables the codes index, and each column's dtype), then the
columns, each padded to 8 bytes (`schemas.binary_columns`). Each integer column is stored
in the narrowest dtype its values fit; an op's start is stored as its distance from the
rank's previous op (a rank's ops are in start order once assembled), so most columns take
1–4 bytes per op instead of 8.
Decoding checks everything a merge relies on (lengths, offsets, codes inside their tables)
and raises `InvalidMessage`, so a corrupt message is dead-lettered, not merged.

>>> import numpy as np
>>> from schemas.frame import StepFrame
>>> f = StepFrame(job="j", step=4, rank=np.array([8, 9]), node=np.array([0, 0], np.int32),
...     nodes=["n2"], local_rank=np.array([0, 1], np.int32),
...     coords=np.full((2, 5), -1, np.int32), t_start_ns=np.array([10**18, 10**18]),
...     t_end_ns=np.array([10**18 + 50, 10**18 + 60]), off=np.array([0, 2, 3]),
...     op_kind=np.array([0, 1, 1], np.uint8), op_name=np.array([0, 1, 1], np.int32),
...     op_group=np.array([0, 1, 1], np.int32), op_seq=np.array([0, 3, 3]),
...     op_start_ns=np.array([0, 20, 5]), op_dur_ns=np.array([20, 30, 40]),
...     op_bytes=np.array([0, 4096, 4096]), names=["fwd", "all_reduce"],
...     groups=["", "dp.0"], missing=np.array([10]))
>>> raw = encode_partial(f, shard=1, shard_ranks=8)
>>> p = decode_partial(raw)
>>> (p.shard, p.shard_ranks, p.frame.op_start_ns.tolist(), p.frame.missing.tolist())
(1, 8, [0, 20, 5], [10])
>>> decode_partial(raw[:-3])
Traceback (most recent call last):
...
schemas.errors.InvalidMessage: $: truncated: the columns need ... bytes, the message has ...
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgspec
import numpy as np

from schemas.binary_columns import ALIGN, pack_columns, pad, read_columns
from schemas.errors import InvalidMessage
from schemas.frame import StepFrame
from schemas.rankstep import COORD_DIMS, OP_KINDS

MAGIC = b"FLP1"
# The watermark of a shard stage 1 let go of (silent past the job's idle time): stage 2 no
# longer waits for it.
GONE = 2**63 - 1
_HEAD = struct.Struct("<4sI")
# Each column: (field of StepFrame, the dtype it has in a frame, stored as a delta per rank).
_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("rank", "int64", False),
    ("node", "int32", False),
    ("local_rank", "int32", False),
    ("coords", "int32", False),
    ("t_start_ns", "int64", False),
    ("t_end_ns", "int64", False),
    ("off", "int64", False),
    ("op_kind", "uint8", False),
    ("op_name", "int32", False),
    ("op_group", "int32", False),
    ("op_seq", "int64", False),
    ("op_start_ns", "int64", True),
    ("op_dur_ns", "int64", False),
    ("op_bytes", "int64", False),
    ("missing", "int64", False),
    ("stall_rank", "int64", False),
    ("stall_name", "int32", False),
    ("stall_ns", "int64", False),
)


class _Header(msgspec.Struct, frozen=True):
    v: int
    job: str
    step: int
    shard: int
    shard_ranks: int
    watermark_ns: int
    names: list[str]
    groups: list[str]
    nodes: list[str]
    dtypes: list[str]  # stored dtype of each column, in `_COLUMNS` order
    sizes: list[int]  # elements of each column


_encode_header = msgspec.json.Encoder().encode
_decode_header = msgspec.json.Decoder(_Header).decode


@dataclass(slots=True)
class PartialFrame:
    """One shard's assembled step: the ranks `shard * shard_ranks` up to the next shard's."""

    shard: int
    shard_ranks: int
    frame: StepFrame  # no ranks: a watermark alone
    # Stage 1 has read everything of the shard up to this stream time (the latest end of its
    # ranks' steps, moved on by its clock while it has nothing left to read): stage 2 waits
    # for a shard's step until this passes the step's grace, however far stage 1 lags.
    watermark_ns: int = 0

    @property
    def job(self) -> str:
        return self.frame.job

    @property
    def t_end_ns(self) -> int:
        """Its event time: when the shard's last rank ended the step; for a watermark
        alone, the watermark (0 for the last one, `GONE`)."""
        if self.frame.n_ranks:
            return int(self.frame.t_end_ns.max())
        return self.watermark_ns if self.watermark_ns != GONE else 0


def _rank_deltas(values: np.ndarray, off: np.ndarray) -> np.ndarray:
    """Each value less the previous one of its rank (a rank's first keeps its value)."""
    d = np.empty_like(values)
    if values.size:
        d[0] = values[0]
        np.subtract(values[1:], values[:-1], out=d[1:])
        firsts = off[:-1][off[:-1] < off[1:]]  # the first row of each rank with ops
        d[firsts] = values[firsts]
    return d


def _rank_sums(deltas: np.ndarray, off: np.ndarray) -> np.ndarray:
    """The inverse of `_rank_deltas`: a running sum restarted at each rank's first row."""
    total = np.cumsum(deltas, dtype=np.int64)
    if total.size == 0:
        return total
    before = np.concatenate(([0], total))[off[:-1]]  # the sum before each rank's first row
    return total - np.repeat(before, np.diff(off))


def encode_partial(frame: StepFrame, *, shard: int, shard_ranks: int,
                   watermark_ns: int = 0) -> bytes:
    """The bytes of one shard's step (`frame` holds only that shard's ranks; none for a
    watermark alone)."""
    cols = []
    for name, _, delta in _COLUMNS:
        a = np.asarray(getattr(frame, name))
        if delta:
            a = _rank_deltas(a.astype(np.int64, copy=False), frame.off)
        cols.append(a)
    parts, dtypes, sizes = pack_columns(cols)
    header = _encode_header(_Header(
        v=1, job=frame.job, step=frame.step, shard=shard, shard_ranks=shard_ranks,
        watermark_ns=watermark_ns,
        names=list(frame.names), groups=list(frame.groups), nodes=list(frame.nodes),
        dtypes=dtypes, sizes=sizes,
    ))
    return b"".join([_HEAD.pack(MAGIC, len(header)), header, pad(_HEAD.size + len(header)),
                     *parts])


def decode_partial(raw: bytes) -> PartialFrame:
    """The shard's step, with every column in the dtype a `StepFrame` holds.

    InvalidMessage when anything a merge relies on does not hold."""
    if len(raw) < _HEAD.size:
        raise InvalidMessage("$", f"{len(raw)} bytes, shorter than a partial frame's head")
    magic, n_head = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise InvalidMessage("$", f"starts with {magic!r}, not a partial frame ({MAGIC!r})")
    try:
        h = _decode_header(raw[_HEAD.size:_HEAD.size + n_head])
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise InvalidMessage("$.header", f"not a partial frame's header: {e}") from None
    if h.v != 1:
        raise InvalidMessage("$.header.v", f"version {h.v} is not 1")
    if h.shard < 0 or h.shard_ranks < 1:
        raise InvalidMessage("$.header.shard", f"shard {h.shard} of {h.shard_ranks} ranks")
    pos = _HEAD.size + n_head
    pos += -pos % ALIGN
    read = read_columns(raw, pos, h.dtypes, h.sizes, [name for name, _, _ in _COLUMNS])
    cols = {name: (a, dtype, delta) for (name, dtype, delta), a in zip(_COLUMNS, read, strict=True)}
    return PartialFrame(h.shard, h.shard_ranks, _frame_of(h, cols), h.watermark_ns)


def _frame_of(h: _Header, cols: dict[str, tuple[np.ndarray, str, bool]]) -> StepFrame:
    R = cols["rank"][0].size
    off = cols["off"][0].astype(np.int64)
    N = cols["op_kind"][0].size
    if off.size != R + 1 or (R and (off[0] != 0 or off[-1] != N or (np.diff(off) < 0).any())):
        raise InvalidMessage("$.off", f"not the row offsets of {R} ranks over {N} ops")
    per_rank = ("node", "local_rank", "t_start_ns", "t_end_ns")
    per_op = ("op_name", "op_group", "op_seq", "op_start_ns", "op_dur_ns", "op_bytes")
    for name in per_rank:
        if cols[name][0].size != R:
            raise InvalidMessage(f"$.{name}", f"{cols[name][0].size} values for {R} ranks")
    if cols["coords"][0].size != R * len(COORD_DIMS):
        raise InvalidMessage("$.coords", f"{cols['coords'][0].size} values for {R} ranks")
    for name in per_op:
        if cols[name][0].size != N:
            raise InvalidMessage(f"$.{name}", f"{cols[name][0].size} values for {N} ops")
    S = cols["stall_rank"][0].size
    if cols["stall_name"][0].size != S or cols["stall_ns"][0].size != S:
        raise InvalidMessage("$.stall_name", "stall columns of different lengths")
    for name, table in (("op_name", h.names), ("op_group", h.groups), ("node", h.nodes),
                        ("stall_name", h.names), ("stall_rank", range(R)),
                        ("op_kind", OP_KINDS)):
        a = cols[name][0]
        if a.size and (int(a.min()) < 0 or int(a.max()) >= len(table)):
            raise InvalidMessage(f"$.{name}", f"codes outside its table of {len(table)}")
    rank = cols["rank"][0].astype(np.int64)
    lo = h.shard * h.shard_ranks
    if R and (int(rank[0]) < lo or int(rank[-1]) >= lo + h.shard_ranks
              or (np.diff(rank) <= 0).any()):
        raise InvalidMessage("$.rank", f"not ascending ranks of shard {h.shard} "
                                       f"({lo} to {lo + h.shard_ranks - 1})")

    def col(name: str) -> np.ndarray:
        a, dtype, delta = cols[name]
        if delta:
            return _rank_sums(a, off)
        return a.astype(dtype)  # a copy: the frame's arrays are writable and own their data

    return StepFrame(
        job=h.job, step=h.step, rank=rank, node=col("node"), nodes=h.nodes,
        local_rank=col("local_rank"), coords=col("coords").reshape(R, len(COORD_DIMS)),
        t_start_ns=col("t_start_ns"), t_end_ns=col("t_end_ns"), off=off,
        op_kind=col("op_kind"), op_name=col("op_name"), op_group=col("op_group"),
        op_seq=col("op_seq"), op_start_ns=col("op_start_ns"), op_dur_ns=col("op_dur_ns"),
        op_bytes=col("op_bytes"), names=h.names, groups=h.groups, missing=col("missing"),
        stall_rank=col("stall_rank"), stall_name=col("stall_name"), stall_ns=col("stall_ns"),
    )


def encode_watermark(job: str, *, shard: int, shard_ranks: int, watermark_ns: int) -> bytes:
    """A watermark alone: stage 1 read the shard up to `watermark_ns` and has no step of it
    to send (its ranks are silent, or their step still waits for one of them)."""
    none = np.zeros(0, dtype=np.int64)
    frame = StepFrame(
        job=job, step=-1, rank=none, node=none.astype(np.int32), nodes=[],
        local_rank=none.astype(np.int32), coords=np.zeros((0, len(COORD_DIMS)), np.int32),
        t_start_ns=none, t_end_ns=none, off=np.zeros(1, np.int64), op_kind=none.astype(np.uint8),
        op_name=none.astype(np.int32), op_group=none.astype(np.int32), op_seq=none,
        op_start_ns=none, op_dur_ns=none, op_bytes=none, names=[], groups=[], missing=none,
    )
    return encode_partial(frame, shard=shard, shard_ranks=shard_ranks, watermark_ns=watermark_ns)
