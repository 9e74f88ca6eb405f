"""Storage's test doubles: hand-made StepReport / StepFrame / incident objects, a sample data
set, and `MemoryStore`, an in-memory stand-in for ClickHouse.

No detector is involved: every number is chosen here, so a test can state what it expects to
read back. `MemoryStore` implements the reader (`storage.reader.Reader`) and the methods of
`storage.writer.Sink` that the stream pipeline calls, so API routes get unit tests without
chDB and stream tests can use it as their sink; tests/integration/test_storage_testing.py
checks that it answers every read exactly as `Queries` over chDB does. Test support, not
product code: nothing outside tests imports it. (pytest collects no tests from here.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas.frame import StepFrame
from schemas.rankstep import COLL, COMPUTE, COORD_DIMS
from schemas.report import Detection, DiagnoserOutput, GroupRows, RankRows, StepReport
from schemas.wire import DeadLetterV1, IncidentV1, Suspect
from storage.client import StorageError
from storage.reader import (
    DEAD_LETTER_COLUMNS,
    INCIDENT_COLUMNS,
    OP_COLUMNS,
    RANK_FIGURES,
    STEP_COLUMNS,
    RankSort,
    Reader,
    Row,
    bucket_width,
    incident_from_row,
    rank_figure,
)
from storage.tables import (
    BY_NAME,
    DEAD_LETTERS,
    INCIDENTS,
    JOB_STEPS,
    OPS,
    Column,
    Interned,
    OpRows,
    Table,
)
from storage.writer import write_taken

if TYPE_CHECKING:
    from storage.writer import Sink

T0_NS = 1_790_000_000 * 10**9  # a node-clock time; TTLs run on the server clock instead
STEP_NS = 2 * 10**9


def step_ts(step: int) -> int:
    return T0_NS + step * STEP_NS


def make_frame(
    job: str, step: int, n_ranks: int = 4, ops_per_rank: int = 2, slow_rank: int | None = None
) -> StepFrame:
    """Two ranks per node; each rank: one compute op (900 ns), then all_reduces on dp.0, one
    per µs. `slow_rank` computes 450 ns longer, so its later ops start 450 ns later and the
    others' first all_reduce waits for it: every copy of that all_reduce ends together."""
    rank = np.arange(n_ranks, dtype=np.int64)
    n = n_ranks * ops_per_rank
    kinds = np.tile(np.array([COMPUTE] + [COLL] * (ops_per_rank - 1), np.uint8), n_ranks)
    per_op = np.arange(ops_per_rank, dtype=np.int64)
    start = np.tile(per_op * 1000, (n_ranks, 1))
    dur = np.full((n_ranks, ops_per_rank), 900, np.int64)
    if slow_rank is not None and ops_per_rank > 1:
        dur[slow_rank, 0] += 450
        start[slow_rank, 1:] += 450
        dur[np.arange(n_ranks) != slow_rank, 1] += 450
    return StepFrame(
        job=job, step=step, rank=rank, node=(rank // 2).astype(np.int32),
        nodes=[f"node-{i}" for i in range((n_ranks + 1) // 2)] + ["node-unused"],
        local_rank=(rank % 2).astype(np.int32),
        coords=np.full((n_ranks, len(COORD_DIMS)), -1, np.int32),
        t_start_ns=np.full(n_ranks, step_ts(step), np.int64),
        t_end_ns=np.full(n_ranks, step_ts(step) + STEP_NS // 2, np.int64),
        off=np.arange(0, n + 1, ops_per_rank, dtype=np.int64),
        op_kind=kinds, op_name=np.tile(per_op.astype(np.int32), n_ranks),
        op_group=(kinds == COLL).astype(np.int32), op_seq=np.tile(per_op, n_ranks) + 100 * step,
        op_start_ns=start.ravel(), op_dur_ns=dur.ravel(),
        op_bytes=np.where(kinds == COLL, 1 << 20, 0).astype(np.int64),
        names=["fwd", "all_reduce", "bwd", "optimizer"][:ops_per_rank]
        + [f"op{i}" for i in range(4, ops_per_rank)],
        groups=["", "dp.0"], missing=np.zeros(0, np.int64),
    )


def make_report(
    job: str, step: int, *, n_ranks: int = 4, step_time_s: float = 1.0, baseline_s: float = 1.0,
    irregular: str = "normal", slow_rank: int | None = None,
    detections: list[Detection] | None = None, with_frame: bool = False,
) -> StepReport:
    """One step: every rank computes 0.6 s; `slow_rank` computes 50% more and makes the
    others wait; rank r's gap is 0.01 * r so per-rank sorting has a known order."""
    rank = np.arange(n_ranks, dtype=np.int64)
    compute, caused, wait = np.full(n_ranks, 0.6), np.zeros(n_ranks), np.zeros(n_ranks)
    if slow_rank is not None:
        compute[slow_rank] = 0.9
        caused[slow_rank] = 0.3 * (n_ranks - 1)
        wait[:] = 0.3
        wait[slow_rank] = 0.0
    return StepReport(
        job=job, step=step, ts_ns=step_ts(step), n_ranks=n_ranks, n_missing=0,
        step_time_s=step_time_s, baseline_s=baseline_s, delta=step_time_s / baseline_s,
        irregular=irregular, level_shift=False,
        ranks=RankRows(
            rank=rank, node=[f"node-{r // 2}" for r in range(n_ranks)],
            step_s=np.full(n_ranks, step_time_s), compute_s=compute,
            comm_s=np.full(n_ranks, 0.3) + wait, gap_s=0.01 * rank, wait_s=wait,
            caused_wait_s=caused, compute_ratio=compute / 0.6, n_ops=np.full(n_ranks, 2, np.int64),
        ),
        groups=GroupRows(
            group=["dp.0", "tp.0"], n_members=np.array([n_ranks, 2], np.int64),
            n_instances=np.array([1, 3], np.int64), comm_s=np.array([0.3 * n_ranks, 0.1]),
            transfer_s=np.array([0.2 * n_ranks, 0.1]), wait_s=np.array([wait.sum(), 0.0]),
            transfer_ratio=np.array([1.0, 1.0]),
        ),
        detections=detections or [],
        frame=make_frame(job, step, n_ranks, slow_rank=slow_rank) if with_frame else None,
    )


def make_incident(
    job: str, *, culprit: str = "rank:1", kind: str = "gpu", onset_step: int = 10,
    opened_step: int = 12, last_step: int = 20, status: str = "open",
    resolved_step: int | None = None, opened_ts_ns: int | None = None,
    incident_id: str | None = None, lost_gpu_seconds: float = 12.5,
    lost_gpu_seconds_per_step: float = 1.5,
) -> IncidentV1:
    return IncidentV1(
        v=1, id=incident_id or f"{job}/{kind}/{culprit}/{onset_step}", job=job,
        status=status, kind=kind, culprit=culprit,  # type: ignore[arg-type]
        suspects=[Suspect(culprit, 0.9), Suspect("node:node-0", 0.1)],
        onset_step=onset_step, opened_step=opened_step,
        opened_ts_ns=step_ts(opened_step) if opened_ts_ns is None else opened_ts_ns,
        last_step=last_step, resolved_step=resolved_step, slowdown=1.3,
        lost_gpu_seconds=lost_gpu_seconds, lost_gpu_seconds_per_step=lost_gpu_seconds_per_step,
        evidence_steps=last_step - onset_step + 1,
        summary=f"{culprit} computes 50% slower than its peers",
    )


def make_dead_letter(offset: int, reason: str = "$.v: unsupported version") -> DeadLetterV1:
    return DeadLetterV1(
        v=1, topic="flare.steps.v1", partition=0, offset=offset, reason=reason, payload_b64="e30="
    )


# -- a sample data set ----------------------------------------------------------------------

SAMPLE_JOB = "team/gpt-r7"  # a job id with a slash: routes must still find it


def load_sample(sink: Sink | MemoryStore) -> None:
    """Three jobs, written and flushed. SAMPLE_JOB: 60 steps, rank 1 slow from step 30 (an
    open gpu incident), a spike at 45 and an old resolved link incident; "quiet": 10 steps
    ending in a spike; "many": 3 steps and 7 resolved incidents (two opened at step 100).
    SAMPLE_JOB's raw ops are kept as the worker keeps them: for its irregular steps (30-59)
    and every 100th (step 0), none for the link incident's steps 5-20."""
    for step in range(60):
        slow = step >= 30
        sink.add_report(make_report(
            SAMPLE_JOB, step, slow_rank=1 if slow else None,
            step_time_s=1.5 if step == 45 else (1.2 if slow else 1.0),
            irregular="spike" if step == 45 else ("persistent" if slow else "normal"),
            detections=[Detection("rank:1", "gpu", 6.0, 0.2)] if slow else [],
            with_frame=slow or step == 0,
        ))
    for step in range(10):
        sink.add_report(make_report("quiet", step, irregular="spike" if step == 9 else "normal"))
    for step in range(3):
        sink.add_report(make_report("many", step))
    sink.add_incident(make_incident(SAMPLE_JOB, onset_step=30, opened_step=33, last_step=59))
    sink.add_incident(make_incident(SAMPLE_JOB, culprit="node:node-1", kind="link",
                                    onset_step=5, opened_step=6, last_step=12,
                                    status="resolved", resolved_step=20))
    for i in range(7):
        sink.add_incident(make_incident("many", culprit=f"rank:{i}", onset_step=i,
                                        opened_step=i, last_step=i, status="resolved",
                                        resolved_step=i + 1,
                                        opened_ts_ns=step_ts(100) if i >= 5 else None))
    sink.flush()


# -- the in-memory store --------------------------------------------------------------------

Stored = StepReport | IncidentV1 | DeadLetterV1


def _stored_value(ch_type: str) -> Callable[[Any], Any]:
    """How ClickHouse holds a value of this type, as Python (Float32 keeps float32 precision:
    averages are taken over what is stored, rounding comes only when read)."""
    if ch_type.startswith("Nullable("):
        inner = _stored_value(ch_type[len("Nullable("):-1])
        return lambda v: None if v is None else inner(v)
    if ch_type.startswith("Array("):
        item = _stored_value(ch_type[len("Array("):-1])
        return lambda v: [item(x) for x in v]
    if ch_type == "Float32":
        return lambda v: float(np.float32(v))
    scalar: dict[str, Callable[[Any], Any]] = {"Float64": float, "Bool": bool, "String": str}
    if ch_type in scalar:
        return scalar[ch_type]
    return str if ch_type.startswith("LowCardinality") else int


def _read(row: Row, columns: Iterable[Column]) -> Row:
    """A stored row as a whole-row read returns it (see `storage.reader`)."""
    return {c.read_name: round(row[c.name], 6) if c.type == "Float32" else row[c.name]
            for c in columns}


# The rows the Sink writes of one report, per table the reader reads (ops: from the frame).
_REPORT_ROWS: tuple[tuple[str, Callable[[StepReport], int]], ...] = (
    ("job_steps", lambda r: 1), ("rank_steps", lambda r: len(r.ranks.rank)),
    ("group_steps", lambda r: len(r.groups.group)), ("detections", lambda r: len(r.detections)),
)


class MemoryStore(Reader):
    """Rows in memory behind the reader's interface and the sink's (add_*, flush).

    Written items wait in `buffered` until `flush` moves them to `stored` (what stream tests
    inspect); reads see stored rows only, one per natural key (the last written wins, and the
    highest version for incidents: the ReplacingMergeTree semantics). Set `fail` to make
    flushes and reads raise StorageError and `ping` answer False, as a ClickHouse that is down.
    """

    def __init__(self) -> None:
        self.buffered: list[Stored] = []
        self.stored: list[Stored] = []
        self.fail = False
        self._tables: dict[str, dict[tuple[Any, ...], Row]] | None = None

    def _check(self, what: str) -> None:
        if self.fail:
            raise StorageError(f"ClickHouse at memory: {what} failed: the store is set to fail")

    # -- the sink's side ---------------------------------------------------------------------

    def add_report(self, report: StepReport) -> None:
        self.buffered.append(report)

    def add_reports(self, reports: Iterable[StepReport]) -> None:
        self.buffered.extend(reports)

    def add_incident(self, inc: IncidentV1) -> None:
        self.buffered.append(inc)

    def add_output(self, out: DiagnoserOutput) -> None:
        self.buffered.extend(out.incidents)
        self.buffered.extend(out.reports)

    def add_dead_letter(self, dl: DeadLetterV1) -> None:
        self.buffered.append(dl)

    @property
    def full(self) -> bool:
        """Never: this store holds what it is given (`Sink.full`)."""
        return False

    def take(self) -> MemoryRows:
        """What is buffered, moved out to be written (as `Sink.take`)."""
        rows = MemoryRows(self, self.buffered)
        self.buffered = []
        return rows

    def flush(self) -> dict[str, int]:
        """Store what is buffered; returns rows per table as `Sink.flush` counts them."""
        return write_taken(self.take())

    def _rows(self, table: Table) -> list[Row]:
        """The stored rows of a table, one per natural key: the newest write wins, and for
        incidents the highest version (ReplacingMergeTree as FINAL reads it)."""
        self._check("query")
        if self._tables is None:
            self._tables = defaultdict(dict)
            for item in self.stored:
                if isinstance(item, StepReport):
                    for name, n in _REPORT_ROWS:
                        self._put(BY_NAME[name], n(item), item)
                    if item.frame is not None and item.frame.n_ops:
                        self._put(OPS, item.frame.n_ops, OpRows.of(item))
                else:
                    self._put(INCIDENTS if isinstance(item, IncidentV1) else DEAD_LETTERS, 1,
                              [item])
        return list(self._tables[table.name].values())

    def _put(self, table: Table, n: int, root: Any) -> None:
        """n rows taken from `root` through the table's spec, as the writer takes them."""
        assert self._tables is not None
        columns = []
        for c in table.written:
            value, convert = c.take(root), _stored_value(c.type)
            if isinstance(value, Interned):  # codes into a string table, as the writer sends
                value = [value.table[code] for code in value.codes]
            elif isinstance(value, str) or np.ndim(value) == 0:
                value = [value] * n
            columns.append([convert(v) for v in value])
        rows = self._tables[table.name]
        for values in zip(*columns, strict=True):
            row = {c.name: v for c, v in zip(table.written, values, strict=True)}
            key = tuple(row[k] for k in table.key)
            held = rows.pop(key, None)  # the newest row goes last, as an insert would
            if table is INCIDENTS and held is not None and held["version"] > row["version"]:
                row = held
            rows[key] = row

    # -- the reader's side -------------------------------------------------------------------

    def ping(self) -> bool:
        return not self.fail

    def incidents(
        self, *, job: str | None = None, status: str | None = None, kind: str | None = None,
        since_ns: int | None = None, until_ns: int | None = None, limit: int = 100,
        offset: int = 0, before: tuple[int, str] | None = None,
    ) -> list[Row]:
        rows = [
            r for r in self._rows(INCIDENTS)
            if (job is None or r["job"] == job) and (status is None or r["status"] == status)
            and (kind is None or r["kind"] == kind)
            and (since_ns is None or r["opened_ts"] >= since_ns)
            and (until_ns is None or r["opened_ts"] < until_ns)
            and (before is None or (r["opened_ts"], r["id"]) < before)
        ]
        rows.sort(key=lambda r: (r["opened_ts"], r["id"]), reverse=True)
        return [incident_from_row(_read(r, INCIDENT_COLUMNS)) for r in rows[offset:offset + limit]]

    def incident(self, incident_id: str) -> Row | None:
        for r in self._rows(INCIDENTS):
            if r["id"] == incident_id:
                return incident_from_row(_read(r, INCIDENT_COLUMNS))
        return None

    def detections(
        self, job: str, entity: str, from_step: int, to_step: int, limit: int = 10_000
    ) -> list[Row]:
        rows = sorted(
            (r for r in self._rows(BY_NAME["detections"])
             if r["job"] == job and r["entity"] == entity and from_step <= r["step"] <= to_step),
            key=lambda r: (r["step"], r["kind"]),
        )
        return [{"step": r["step"], "kind": r["kind"], "score": round(r["score"], 6),
                 "excess_s": round(r["excess_s"], 6)} for r in rows[:limit]]

    def _summaries(self, keep: Callable[[str], bool]) -> dict[str, Row]:
        newest: dict[str, Row] = {}
        count: dict[str, int] = defaultdict(int)
        for r in self._rows(JOB_STEPS):
            if keep(r["job"]):
                count[r["job"]] += 1
                if r["job"] not in newest or r["step"] > newest[r["job"]]["step"]:
                    newest[r["job"]] = r
        opened: dict[str, int] = defaultdict(int)
        total: dict[str, int] = defaultdict(int)
        for inc in self._rows(INCIDENTS):
            total[inc["job"]] += 1
            opened[inc["job"]] += inc["status"] == "open"
        return {
            job: {"job": job, "steps": count[job], "last_step": r["step"], "last_ts_ns": r["ts"],
                  "step_time_s": r["step_time_s"], "baseline_s": r["baseline_s"],
                  "delta": r["delta"], "irregular": r["irregular"], "n_ranks": r["n_ranks"],
                  "open_incidents": opened[job], "incidents": total[job]}
            for job, r in newest.items()
        }

    def jobs(self, *, limit: int = 100, offset: int = 0) -> list[Row]:
        summaries = self._summaries(lambda job: True)
        return [summaries[job] for job in sorted(summaries)[offset:offset + limit]]

    def job(self, job: str) -> Row | None:
        return self._summaries(lambda j: j == job).get(job)

    def last_step(self, job: str) -> int | None:
        return max((r["step"] for r in self._rows(JOB_STEPS) if r["job"] == job), default=None)

    def steps(
        self, job: str, *, from_step: int | None = None, to_step: int | None = None,
        limit: int = 1000, stride: int = 1, irregular: list[str] | None = None,
    ) -> list[Row]:
        lo = from_step or 0
        rows = sorted(
            (r for r in self._rows(JOB_STEPS) if r["job"] == job and r["step"] >= lo
             and (to_step is None or r["step"] <= to_step) and (r["step"] - lo) % stride == 0
             and (not irregular or r["irregular"] in irregular)),
            key=lambda r: r["step"], reverse=from_step is None,
        )[:limit]
        return [_read(r, STEP_COLUMNS) for r in (rows if from_step is not None else rows[::-1])]

    def rank_scores(
        self, job: str, from_step: int, to_step: int, *, sort: RankSort = "rank",
        limit: int = 10_000,
    ) -> list[Row]:
        by_rank: dict[int, list[Row]] = defaultdict(list)
        for r in self._rows(BY_NAME["rank_steps"]):
            if r["job"] == job and from_step <= r["step"] <= to_step:
                by_rank[r["rank"]].append(r)
        scores = []
        for rank, rows in by_rank.items():
            score: Row = {"rank": rank, "node": rows[0]["node"], "steps": len(rows)}
            for c in RANK_FIGURES:
                score[c.name] = round(sum(r[c.name] for r in rows) / len(rows), 6)
            score["caused_wait_total_s"] = round(sum(r["caused_wait_s"] for r in rows), 6)
            score["min_compute_ratio"] = round(min(r["compute_ratio"] for r in rows), 6)
            scores.append(score)
        scores.sort(key=_RANK_KEYS[sort])
        return scores[:limit]

    def rank_buckets(
        self, job: str, from_step: int, to_step: int, buckets: int, figure: str, *,
        ranks: list[int] | None = None, limit: int = 100_000,
    ) -> list[Row]:
        name, width = rank_figure(figure), bucket_width(from_step, to_step, buckets)
        wanted = None if ranks is None else set(ranks)
        cells: dict[tuple[int, int], list[float]] = defaultdict(list)
        for r in self._rows(BY_NAME["rank_steps"]):
            if (r["job"] == job and from_step <= r["step"] <= to_step
                    and (wanted is None or r["rank"] in wanted)):
                cells[r["rank"], (r["step"] - from_step) // width].append(r[name])
        return [{"rank": rank, "bucket": bucket, "value": round(sum(v) / len(v), 6)}
                for (rank, bucket), v in sorted(cells.items())[:limit]]

    def op_steps(self, job: str, from_step: int, to_step: int, limit: int = 100) -> list[Row]:
        count: dict[int, int] = defaultdict(int)
        for r in self._rows(OPS):
            if r["job"] == job and from_step <= r["step"] <= to_step:
                count[r["step"]] += 1
        return [{"step": step, "ops": count[step]} for step in sorted(count)[:limit]]

    def ops(self, job: str, steps: list[int], limit: int = 100_000) -> list[Row]:
        wanted = set(steps)
        rows = sorted((r for r in self._rows(OPS) if r["job"] == job and r["step"] in wanted),
                      key=lambda r: (r["step"], r["rank"], r["ord"]))
        return [_read(r, OP_COLUMNS) for r in rows[:limit]]

    def dead_letters(self, *, topic: str | None = None, limit: int = 100) -> list[Row]:
        rows = sorted((r for r in self._rows(DEAD_LETTERS) if topic is None or r["topic"] == topic),
                      key=lambda r: (r["topic"], r["partition"], -r["offset"]))
        return [_read(r, DEAD_LETTER_COLUMNS) for r in rows[:limit]]


_RANK_KEYS: dict[str, Callable[[Row], Any]] = {  # the ORDER BY of Queries.rank_scores
    "rank": lambda s: s["rank"],
    "caused_wait": lambda s: (-s["caused_wait_s"], s["rank"]),
    "compute_ratio": lambda s: (s["compute_ratio"], s["rank"]),
    "gap": lambda s: (-s["gap_s"], s["rank"]),
}


class MemoryRows:
    """Items taken out of a `MemoryStore`, as `storage.writer.SinkRows` are out of a Sink:
    `write` stores them (raising StorageError while the store is set to fail), `settle`
    puts them back in front of newer ones when the write failed."""

    def __init__(self, store: MemoryStore, items: list[Stored]) -> None:
        self._store = store
        self.items = items

    def write(self) -> dict[str, int]:
        """Store the items; rows per table as `Sink.flush` counts them."""
        store = self._store
        store._check("insert")
        written: dict[str, int] = defaultdict(int)
        incidents, dead = set(), set()
        for item in self.items:
            if isinstance(item, StepReport):
                for table, n in _REPORT_ROWS:
                    written[table] += n(item)
                written["ops"] += item.frame.n_ops if item.frame is not None else 0
            elif isinstance(item, IncidentV1):
                incidents.add(item.id)
            else:
                dead.add((item.topic, item.partition, item.offset))
        written["incidents"], written["dead_letters"] = len(incidents), len(dead)
        store.stored.extend(self.items)
        store._tables = None
        self.items = []
        return {table: n for table, n in written.items() if n}

    def settle(self, *, stored: bool) -> None:
        """After a failed write, the items go back in front of those added meanwhile."""
        if not stored:
            self._store.buffered[:0] = self.items
        self.items = []

