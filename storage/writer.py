"""The batched ClickHouse writer: step reports, incidents and dead letters, one INSERT per table
per flush.

An INSERT costs a few milliseconds whatever its size (chDB ~3–5 ms), while one 8k-rank step
is 8k rank rows, so rows are buffered per table as Arrow column chunks (`storage.arrow`:
converted and checked when added, so a bad report is refused alone instead of poisoning a
whole flush) and written with `insert_arrow` once per flush. Which columns each table has and
where their values come from is `storage.tables`. The caller flushes before committing its
Kafka offsets (that flush raises StorageError on failure); the sink also flushes by itself
past `max_rows` (a failure there keeps the rows and is left for the explicit flush to
report). Rows carry their natural keys (job, step, rank …; incident id; topic, partition,
offset) and the tables are ReplacingMergeTree, so a re-delivery after a crash rewrites rows
instead of duplicating.

Not thread-safe: one owner (the worker's loop) adds, takes and flushes. The one part that may
run on another thread is `SinkRows.write`: the owner `take`s what is buffered and hands it to
a thread, so a ClickHouse that never answers holds that thread, not the owner, and rows added
meanwhile go to fresh buffers that the write never sees. The owner then `settle`s it: rows a
failed write left go back in front of the newer ones.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from schemas.report import DiagnoserOutput, StepReport
from schemas.wire import DeadLetterV1, IncidentV1
from storage.arrow import Buffer, Chunk
from storage.client import ClickHouse, StorageError
from storage.tables import TABLES, OpRows, incident_version

log = logging.getLogger(__name__)

FLUSH_ORDER: tuple[str, ...] = tuple(t.name for t in TABLES)


@dataclass(slots=True)
class SinkStats:
    """Rows written per table since the sink was built, and flushes done."""

    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FLUSH_ORDER, 0))
    flushes: int = 0
    failed_flushes: int = 0  # automatic ones; an explicit flush raises instead


class Sink:
    """Buffers Flare's rows and writes each table with one `insert_arrow` per flush."""

    def __init__(self, db: ClickHouse, *, max_rows: int = 100_000,
                 flush_when_full: bool = True) -> None:
        """`flush_when_full`: write by itself, on the adding thread, once `max_rows` wait.
        An owner that must never wait on ClickHouse (the worker's event loop) turns it off,
        watches `full` and writes the rows on a thread of its own instead."""
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.db = db
        self.max_rows = max_rows
        self.flush_when_full = flush_when_full
        self.stats = SinkStats()
        self._buffers = {t.name: Buffer(t) for t in TABLES}
        self._incidents: dict[str, tuple[int, IncidentV1]] = {}
        self._dead: dict[tuple[str, int, int], DeadLetterV1] = {}
        self._retry_at = 0

    @property
    def pending_rows(self) -> int:
        """Rows buffered and not yet written."""
        return sum(b.rows for b in self._buffers.values()) + len(self._incidents) + len(self._dead)

    @property
    def full(self) -> bool:
        """`max_rows` or more rows wait: time to write them (see `flush_when_full`)."""
        return self.pending_rows >= self.max_rows

    # -- adding ------------------------------------------------------------------------------

    def add_report(self, report: StepReport) -> None:
        """All rows of one step: job_steps, rank_steps, group_steps, detections and, when the
        report kept its frame, the raw ops. A malformed report raises ValueError (naming the
        table and column) and adds nothing."""
        b = self._buffers
        chunks: list[Chunk] = [b["job_steps"].build(1, report)]
        if n := len(report.ranks.rank):
            chunks.append(b["rank_steps"].build(n, report))
        if n := len(report.groups.group):
            chunks.append(b["group_steps"].build(n, report))
        if n := len(report.detections):
            chunks.append(b["detections"].build(n, report))
        if report.frame is not None and report.frame.n_ops:
            chunks.append(b["ops"].build(report.frame.n_ops, OpRows.of(report)))
        for chunk in chunks:
            chunk.buffer.commit(chunk)
        self._maybe_flush()

    def add_reports(self, reports: Iterable[StepReport]) -> None:
        for report in reports:
            self.add_report(report)

    def add_incident(self, inc: IncidentV1) -> None:
        """One incident state; of several states of one id in a batch only the newest is kept.
        A malformed incident raises ValueError here, never later in `flush`."""
        version = incident_version(inc)
        self._buffers["incidents"].build(1, [inc])
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
        self._buffers["dead_letters"].build(1, [dl])
        self._dead[(dl.topic, dl.partition, dl.offset)] = dl
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        """Flush by row count. A storage failure here is not raised (adding never fails for
        the database's sake): rows stay buffered, the next try waits for another `max_rows`,
        and the caller's explicit `flush` reports the failure before it commits offsets."""
        if not self.flush_when_full:
            return
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
            incs = [inc for _version, inc in self._incidents.values()]
            self._buffers["incidents"].append(len(incs), incs)
            self._incidents.clear()
        if self._dead:
            dls = list(self._dead.values())
            self._buffers["dead_letters"].append(len(dls), dls)
            self._dead.clear()

    def take(self) -> SinkRows:
        """Everything buffered, moved out of the sink to be written (`SinkRows.write`, on any
        thread); the sink starts afresh, so rows added meanwhile are not part of that write.
        The owner must `settle` it before taking again, or a failed write's rows could be
        written after newer ones."""
        self._stage_small()
        taken = {name: buf for name, buf in self._buffers.items() if buf.rows}
        for name, buf in taken.items():
            self._buffers[name] = Buffer(buf.table)
        return SinkRows(self, taken)

    def flush(self) -> dict[str, int]:
        """Write every buffered table (one INSERT each); returns rows written per table.

        On a storage failure the tables not yet written keep their rows and StorageError is
        raised: the caller must not commit its offsets, and may flush again later (tables
        already written are rewritten harmlessly: ReplacingMergeTree).
        """
        return write_taken(self.take())


class TakenRows(Protocol):
    """Rows taken out of a sink (`SinkRows`, or the test store's)."""

    def write(self) -> dict[str, int]: ...

    def settle(self, *, stored: bool) -> None: ...


def write_taken(rows: TakenRows) -> dict[str, int]:
    """Write taken rows on this thread and settle them (what was not written goes back):
    a sink's own `flush`, for an owner that may wait on ClickHouse."""
    try:
        written = rows.write()
    except BaseException:
        rows.settle(stored=False)
        raise
    rows.settle(stored=True)
    return written


class SinkRows:
    """Rows taken out of a `Sink`: written by any one thread, then settled by the sink's owner.

    `write` touches only these rows and the client (whose own lock serializes statements), never
    the sink, which its owner keeps filling meanwhile.
    """

    def __init__(self, sink: Sink, buffers: dict[str, Buffer]) -> None:
        self._sink = sink
        self._buffers = buffers  # per table, the rows not yet written
        self.written: dict[str, int] = {}

    @property
    def rows(self) -> int:
        """Rows taken and not yet written."""
        return sum(b.rows for b in self._buffers.values())

    def write(self) -> dict[str, int]:
        """One INSERT per table, in `FLUSH_ORDER`; returns rows written per table. A table is
        dropped from these rows once its INSERT returned, so after a StorageError only the
        tables not yet written remain (a retry rewrites none twice, though doing so would be
        harmless: ReplacingMergeTree)."""
        db = self._sink.db
        for name in FLUSH_ORDER:
            buf = self._buffers.get(name)
            if buf is None:
                continue
            db.insert_arrow(db.table(name), buf.to_arrow())  # StorageError: kept
            self.written[name] = buf.rows
            del self._buffers[name]
        return dict(self.written)

    def settle(self, *, stored: bool) -> None:
        """Back on the sink's owner, once `write` returned or raised: count what was written,
        and put what was not back in the sink, in front of the rows added meanwhile."""
        sink = self._sink
        for name, n in self.written.items():
            sink.stats.rows[name] += n
        if stored:
            sink.stats.flushes += 1
        for name, buf in self._buffers.items():
            buf.extend(sink._buffers[name])
            sink._buffers[name] = buf
        self._buffers = {}
        self.written = {}
