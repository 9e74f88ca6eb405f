"""The batched ClickHouse writer: step reports, incidents and dead letters, one INSERT per table
per flush.

An INSERT costs a few milliseconds whatever its size (chDB ~3–5 ms), while one 8k-rank step
is 8k rank rows, so rows are buffered per table as Arrow column chunks (converted and checked
when added, so a bad report is refused alone instead of poisoning a whole flush) and written
with `insert_arrow` once per flush. The caller flushes before committing its Kafka offsets
(that flush raises StorageError on failure); the sink also flushes by itself past `max_rows`
(a failure there keeps the rows and is left for the explicit flush to report). Rows carry
their natural keys (job, step, rank …; incident id; topic, partition, offset) and the tables
are ReplacingMergeTree, so a re-delivery after a crash rewrites rows instead of duplicating.

Not thread-safe: one owner (the worker's loop) adds and flushes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.frame import StepFrame
from schemas.rankstep import OP_KINDS
from schemas.report import DiagnoserOutput, StepReport
from schemas.wire import DeadLetterV1, IncidentV1
from storage.client import ClickHouse, StorageError

STR = pa.string()
LC = pa.dictionary(pa.int32(), pa.string())  # LowCardinality(String)
TS = pa.timestamp("ns", tz="UTC")  # DateTime64(9, 'UTC')
F32, F64 = pa.float32(), pa.float64()
U32, U64, I32, I64 = pa.uint32(), pa.uint64(), pa.int32(), pa.int64()
log = logging.getLogger(__name__)

SCHEMAS: dict[str, pa.Schema] = {
    "job_steps": pa.schema(
        [("job", LC), ("step", U64), ("ts", TS), ("n_ranks", U32), ("n_missing", U32),
         ("step_time_s", F64), ("baseline_s", F64), ("delta", F64), ("irregular", LC),
         ("level_shift", pa.bool_()), ("n_detections", U32)]
    ),
    "rank_steps": pa.schema(
        [("job", LC), ("step", U64), ("rank", U32), ("ts", TS), ("node", LC), ("step_s", F32),
         ("compute_s", F32), ("comm_s", F32), ("gap_s", F32), ("wait_s", F32),
         ("caused_wait_s", F32), ("compute_ratio", F32), ("n_ops", U32)]
    ),
    "group_steps": pa.schema(
        [("job", LC), ("step", U64), ("group_name", LC), ("ts", TS), ("n_members", U32),
         ("n_instances", U32), ("comm_s", F32), ("transfer_s", F32), ("wait_s", F32),
         ("transfer_ratio", F32)]
    ),
    "ops": pa.schema(
        [("job", LC), ("step", U64), ("rank", U32), ("ord", U32), ("ts", TS), ("node", LC),
         ("t_start", TS), ("kind", LC), ("name", LC), ("group_name", LC), ("seq", I64),
         ("start_ns", I64), ("dur_ns", I64), ("bytes", I64)]
    ),
    "detections": pa.schema(
        [("job", LC), ("entity", STR), ("kind", LC), ("step", U64), ("ts", TS),
         ("score", F32), ("excess_s", F32)]
    ),
    "incidents": pa.schema(
        [("id", STR), ("job", LC), ("status", LC), ("kind", LC), ("culprit", STR),
         ("suspect_entities", pa.list_(STR)), ("suspect_confidences", pa.list_(F64)),
         ("onset_step", I64), ("opened_step", I64), ("opened_ts", TS), ("last_step", I64),
         ("resolved_step", I64), ("slowdown", F64), ("lost_gpu_seconds", F64),
         ("evidence_steps", I64), ("summary", STR), ("version", U64)]
    ),
    "dead_letters": pa.schema(
        [("topic", LC), ("partition", I32), ("offset", I64), ("reason", STR),
         ("payload_b64", STR)]
    ),
}
NULLABLE = frozenset({"resolved_step"})  # every other column refuses nulls when added
# Steps before incidents: a reader that sees an incident finds its evidence rows.
FLUSH_ORDER: tuple[str, ...] = tuple(SCHEMAS)


class Interned:
    """Strings given as codes into a table (how StepFrame stores names, groups, nodes)."""

    __slots__ = ("codes", "table")

    def __init__(self, codes: np.ndarray, table: list[str] | tuple[str, ...]) -> None:
        self.codes = codes
        self.table = table


def _lc(value: Any, n: int) -> pa.Array:
    """A dictionary array with a duplicate-free dictionary (ClickHouse refuses duplicates)."""
    if isinstance(value, str):
        return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([value]))
    if isinstance(value, Interned):
        uniq, inverse = np.unique(np.asarray(value.table, dtype=object), return_inverse=True)
        codes = np.asarray(value.codes, dtype=np.int64)
        if codes.size and (codes.min() < 0 or codes.max() >= len(value.table)):
            raise ValueError("string code out of range of its table")
        return pa.DictionaryArray.from_arrays(
            pa.array(inverse.astype(np.int32)[codes]), pa.array(uniq.tolist(), STR)
        )
    return pa.array(list(value), STR).dictionary_encode()


def _numeric(value: Any, n: int, dtype: type) -> np.ndarray:
    """n numbers: a scalar is broadcast, an array must have exactly n values."""
    a = np.asarray(value)
    if a.ndim == 0:
        return np.full(n, a, dtype=dtype)
    if a.shape != (n,):
        raise ValueError(f"{a.shape[0] if a.ndim else 0} values where the step has {n} rows")
    return a.astype(dtype, copy=False)


def _column(value: Any, n: int, typ: pa.DataType, nullable: bool = False) -> pa.Array:
    """One column chunk of n rows; scalars are broadcast; checks range and length."""
    if typ == LC:
        arr = _lc(value, n)
    elif typ == STR:
        arr = pa.array([value] * n if isinstance(value, str) else list(value), STR)
    elif isinstance(value, pa.Array):
        arr = value.cast(typ)
    elif pa.types.is_floating(typ):
        arr = pa.array(_numeric(value, n, np.float32 if typ == F32 else np.float64))
    elif typ == pa.bool_():
        arr = pa.array(_numeric(value, n, np.bool_))
    elif typ == TS:
        arr = pa.array(_numeric(value, n, np.int64), type=TS)
    else:  # integers: a safe cast refuses negatives for unsigned columns and overflows
        arr = pa.array(_numeric(value, n, np.int64)).cast(typ)
    if len(arr) != n:
        raise ValueError(f"{len(arr)} values where the step has {n} rows")
    if arr.null_count and not nullable:
        raise ValueError(f"{arr.null_count} missing values (null)")
    return arr


@dataclass(slots=True)
class _Chunk:
    """Checked column chunks of some rows of one table, not yet in its buffer."""

    buffer: _Buffer
    n: int
    arrays: list[pa.Array]


class _Buffer:
    """Column chunks of one table, appended per report, joined into one Arrow table per flush."""

    def __init__(self, table: str, schema: pa.Schema) -> None:
        self.table = table
        self.schema = schema
        self.chunks: list[list[pa.Array]] = [[] for _ in schema]
        self.rows = 0

    def build(self, n: int, cols: Mapping[str, Any]) -> _Chunk:
        """Convert and check n rows without adding them (so a report is all or nothing)."""
        built: list[pa.Array] = []
        for f in self.schema:
            try:
                built.append(_column(cols[f.name], n, f.type, f.name in NULLABLE))
            except (ValueError, TypeError, KeyError, OverflowError, pa.ArrowException) as exc:
                raise ValueError(f"{self.table}.{f.name}: {exc}") from exc
        return _Chunk(self, n, built)

    def commit(self, chunk: _Chunk) -> None:
        for chunks, arr in zip(self.chunks, chunk.arrays, strict=True):
            chunks.append(arr)
        self.rows += chunk.n

    def append(self, n: int, cols: Mapping[str, Any]) -> None:
        if n:
            self.commit(self.build(n, cols))

    def to_arrow(self) -> pa.Table:
        columns = [pa.chunked_array(c, type=f.type) for c, f in zip(self.chunks, self.schema,
                                                                   strict=True)]
        table = pa.Table.from_arrays(columns, schema=self.schema)
        return table.unify_dictionaries().combine_chunks()

    def clear(self) -> None:
        self.chunks = [[] for _ in self.schema]
        self.rows = 0


def incident_version(inc: IncidentV1) -> int:
    """Newer states of one incident get larger versions (ReplacingMergeTree keeps the max):
    a later step wins, and at the same step `resolved` wins over `open`."""
    step = max(inc.last_step, inc.resolved_step or 0, 0)
    return 2 * step + (inc.status == "resolved")


def _incident_columns(held: list[tuple[int, IncidentV1]]) -> dict[str, Any]:
    incs = [inc for _v, inc in held]
    return {
        "id": [i.id for i in incs], "job": [i.job for i in incs],
        "status": [i.status for i in incs], "kind": [i.kind for i in incs],
        "culprit": [i.culprit for i in incs],
        "suspect_entities": pa.array([[s.entity for s in i.suspects] for i in incs],
                                     pa.list_(STR)),
        "suspect_confidences": pa.array([[s.confidence for s in i.suspects] for i in incs],
                                        pa.list_(F64)),
        "onset_step": [i.onset_step for i in incs],
        "opened_step": [i.opened_step for i in incs],
        "opened_ts": [i.opened_ts_ns for i in incs],
        "last_step": [i.last_step for i in incs],
        "resolved_step": pa.array([i.resolved_step for i in incs], I64),
        "slowdown": [i.slowdown for i in incs],
        "lost_gpu_seconds": [i.lost_gpu_seconds for i in incs],
        "evidence_steps": [i.evidence_steps for i in incs],
        "summary": [i.summary for i in incs],
        "version": [v for v, _i in held],
    }


def _dead_letter_columns(dls: list[DeadLetterV1]) -> dict[str, Any]:
    return {
        "topic": [d.topic for d in dls], "partition": [d.partition for d in dls],
        "offset": [d.offset for d in dls], "reason": [d.reason for d in dls],
        "payload_b64": [d.payload_b64 for d in dls],
    }


@dataclass(slots=True)
class SinkStats:
    """Rows written per table since the sink was built, and flushes done."""

    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SCHEMAS, 0))
    flushes: int = 0
    failed_flushes: int = 0  # automatic ones; an explicit flush raises instead


class Sink:
    """Buffers Flare's rows and writes each table with one `insert_arrow` per flush."""

    def __init__(self, db: ClickHouse, *, max_rows: int = 100_000) -> None:
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.db = db
        self.max_rows = max_rows
        self.stats = SinkStats()
        self._buffers = {name: _Buffer(name, schema) for name, schema in SCHEMAS.items()}
        self._incidents: dict[str, tuple[int, IncidentV1]] = {}
        self._dead: dict[tuple[str, int, int], DeadLetterV1] = {}
        self._retry_at = 0

    @property
    def pending_rows(self) -> int:
        """Rows buffered and not yet written."""
        return sum(b.rows for b in self._buffers.values()) + len(self._incidents) + len(self._dead)

    # -- adding ------------------------------------------------------------------------------

    def add_report(self, report: StepReport) -> None:
        """All rows of one step: job_steps, rank_steps, group_steps, detections and, when the
        report kept its frame, the raw ops. A malformed report raises ValueError (naming the
        table and column) and adds nothing."""
        b = self._buffers
        key = {"job": report.job, "step": report.step, "ts": report.ts_ns}
        chunks = [b["job_steps"].build(1, {
            **key, "n_ranks": report.n_ranks, "n_missing": report.n_missing,
            "step_time_s": report.step_time_s, "baseline_s": report.baseline_s,
            "delta": report.delta, "irregular": report.irregular,
            "level_shift": report.level_shift, "n_detections": len(report.detections),
        })]
        r = report.ranks
        if len(r.rank):
            chunks.append(b["rank_steps"].build(len(r.rank), {
                **key, "rank": r.rank, "node": r.node, "step_s": r.step_s,
                "compute_s": r.compute_s, "comm_s": r.comm_s, "gap_s": r.gap_s,
                "wait_s": r.wait_s, "caused_wait_s": r.caused_wait_s,
                "compute_ratio": r.compute_ratio, "n_ops": r.n_ops,
            }))
        g = report.groups
        if len(g.group):
            chunks.append(b["group_steps"].build(len(g.group), {
                **key, "group_name": g.group, "n_members": g.n_members,
                "n_instances": g.n_instances, "comm_s": g.comm_s, "transfer_s": g.transfer_s,
                "wait_s": g.wait_s, "transfer_ratio": g.transfer_ratio,
            }))
        d = report.detections
        if d:
            chunks.append(b["detections"].build(len(d), {
                **key, "entity": [x.entity for x in d], "kind": [x.kind for x in d],
                "score": [x.score for x in d], "excess_s": [x.excess_s for x in d],
            }))
        if report.frame is not None and report.frame.n_ops:
            chunks.append(self._frame_chunk(report.frame, report.ts_ns))
        for chunk in chunks:
            chunk.buffer.commit(chunk)
        self._maybe_flush()

    def _frame_chunk(self, f: StepFrame, ts_ns: int) -> _Chunk:
        """Every op of the frame, one row each; strings stay interned (dictionary arrays)."""
        if f.off.shape != (f.n_ranks + 1,) or f.off[-1] != f.n_ops:
            raise ValueError(f"ops: frame offsets do not cover its {f.n_ops} ops")
        ri = f.op_rank_index()
        first = np.repeat(np.asarray(f.off[:-1], np.int64), np.diff(f.off))
        return self._buffers["ops"].build(f.n_ops, {
            "job": f.job, "step": f.step, "ts": ts_ns, "rank": f.rank[ri],
            "ord": np.arange(f.n_ops, dtype=np.int64) - first,
            "node": Interned(f.node[ri], f.nodes), "t_start": f.t_start_ns[ri],
            "kind": Interned(f.op_kind, OP_KINDS), "name": Interned(f.op_name, f.names),
            "group_name": Interned(f.op_group, f.groups), "seq": f.op_seq,
            "start_ns": f.op_start_ns, "dur_ns": f.op_dur_ns, "bytes": f.op_bytes,
        })

    def add_reports(self, reports: Iterable[StepReport]) -> None:
        for report in reports:
            self.add_report(report)

    def add_incident(self, inc: IncidentV1) -> None:
        """One incident state; of several states of one id in a batch only the newest is kept.
        A malformed incident raises ValueError here, never later in `flush`."""
        version = incident_version(inc)
        try:
            cols = _incident_columns([(version, inc)])
        except (pa.ArrowException, TypeError) as exc:
            raise ValueError(f"incidents.suspects: {exc}") from exc
        self._buffers["incidents"].build(1, cols)
        held = self._incidents.get(inc.id)
        if held is None or version >= held[0]:
            self._incidents[inc.id] = (version, inc)
        self._maybe_flush()

    def add_output(self, out: DiagnoserOutput) -> None:
        """Everything one diagnoser call produced (incidents first: a malformed report then
        raises ValueError without costing the incidents)."""
        for inc in out.incidents:
            self.add_incident(inc)
        self.add_reports(out.reports)

    def add_dead_letter(self, dl: DeadLetterV1) -> None:
        """One dead letter; a re-delivered one (same topic, partition, offset) is kept once."""
        self._buffers["dead_letters"].build(1, _dead_letter_columns([dl]))
        self._dead[(dl.topic, dl.partition, dl.offset)] = dl
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        """Flush by row count. A storage failure here is not raised (adding never fails for
        the database's sake): rows stay buffered, the next try waits for another `max_rows`,
        and the caller's explicit `flush` reports the failure before it commits offsets."""
        pending = self.pending_rows
        if pending < max(self.max_rows, self._retry_at):
            return
        try:
            self.flush()
            self._retry_at = 0
        except StorageError as exc:
            self.stats.failed_flushes += 1
            self._retry_at = pending + self.max_rows
            log.warning("automatic flush failed, %d rows kept: %s", pending, exc)

    # -- writing -----------------------------------------------------------------------------

    def _stage_small(self) -> None:
        """Move incidents and dead letters into their column buffers (checked when added)."""
        if self._incidents:
            held = list(self._incidents.values())
            self._buffers["incidents"].append(len(held), _incident_columns(held))
            self._incidents.clear()
        if self._dead:
            dls = list(self._dead.values())
            self._buffers["dead_letters"].append(len(dls), _dead_letter_columns(dls))
            self._dead.clear()

    def flush(self) -> dict[str, int]:
        """Write every buffered table (one INSERT each); returns rows written per table.

        On a storage failure the tables not yet written keep their rows and StorageError is
        raised: the caller must not commit its offsets, and may flush again later (tables
        already written are rewritten harmlessly: ReplacingMergeTree).
        """
        self._stage_small()
        written: dict[str, int] = {}
        for name in FLUSH_ORDER:
            buf = self._buffers[name]
            if buf.rows == 0:
                continue
            self.db.insert_arrow(self.db.table(name), buf.to_arrow())  # StorageError: kept
            written[name] = buf.rows
            self.stats.rows[name] += buf.rows
            buf.clear()
        self.stats.flushes += 1
        return written
