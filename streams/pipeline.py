"""What the worker does with a batch of records, without faust: route, store, emit.

The consumer hands the worker batches of records, acked once handled; this class turns them
into ClickHouse rows (through the batched `Sink`) and outgoing Kafka messages (incidents, dead
letters), and flushes the sink *before* the batch is acked, so an offset is only committed
once its rows are stored (at-least-once; the tables are ReplacingMergeTree on natural keys,
so a re-delivery rewrites instead of duplicating). Valid messages pass through the
event-time merge of their job's topics (`ordering.py`); the ones it still holds when a batch
returns are reported as `held`, so the caller keeps them un-acked until they are processed.

Keeping it free of faust lets the tests drive it with plain lists and a fake clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import msgspec

from schemas.clock import NS_PER_S, NanoClock, SecondsClock
from schemas.report import DiagnoserOutput
from schemas.topics import DEADLETTER, INCIDENTS, ORDERED_TOPICS
from schemas.wire import DeadLetterV1, IncidentV1
from streams.metrics import WorkerMetrics
from streams.ordering import EventTimeMerger
from streams.progress import Progress, Readiness
from streams.routing import Decoded, Diagnoser, JobRouter, Routed

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode

BATCH_MAX = 2000  # records per pipeline call at most, and stored and acked together


class PendingRows(Protocol):
    """Rows taken out of the sink for one write (`storage.writer.SinkRows`)."""

    def write(self) -> object:
        """Write them; the one call that may run on another thread. StorageError: not all
        were written."""
        ...

    def settle(self, *, stored: bool) -> None:
        """On the sink's owner, after `write`: what was not written goes back in the sink."""
        ...


class RowSink(Protocol):
    """What the pipeline needs of `storage.writer.Sink`."""

    def add_output(self, out: DiagnoserOutput) -> None: ...

    def add_dead_letter(self, dl: DeadLetterV1) -> None: ...

    @property
    def full(self) -> bool: ...

    def take(self) -> PendingRows: ...


class Record(NamedTuple):
    """One consumed Kafka record (what faust's `Message` carries that we use).

    A named tuple: one is built per consumed message, and a tuple is the cheapest to build.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    ref: Any = None  # the caller's handle (faust's event), returned when the record is done


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message to publish: an incident update or a dead letter, keyed by job."""

    topic: str
    key: bytes
    value: bytes


@dataclass(slots=True)
class BatchResult:
    """What to publish, and which records are not finished when the batch returns.

    `held`: refs of this batch's records still waiting in the event-time merge (do not ack
    them yet); `finished`: refs of records held by earlier calls and processed now (ack them
    once the sink is flushed).
    """

    outgoing: list[Outgoing] = field(default_factory=list)
    held: list[Any] = field(default_factory=list)
    finished: list[Any] = field(default_factory=list)
    incidents: list[IncidentV1] = field(default_factory=list)  # the states in `outgoing`

    def extend(self, other: BatchResult) -> None:
        """Add a later call's result (one batch handled in several calls)."""
        self.outgoing += other.outgoing
        self.held += other.held
        self.finished += other.finished
        self.incidents += other.incidents


@dataclass(slots=True)
class PipelineStats:
    records: int = 0
    batches: int = 0  # calls of on_records (the worker sizes them to a turn of its loop)
    skipped_not_assigned: int = 0
    skipped_redelivered: int = 0
    incidents: int = 0
    reports: int = 0
    storage_failures: int = 0
    last_storage_error: str = ""
    rebuilt: int = 0  # history messages replayed to rebuild state after an assignment


class Pipeline:
    """Router + event-time merge + sink + progress: the whole per-record path of the worker."""

    def __init__(self, router: JobRouter, sink: RowSink, progress: Progress,
                 merger: EventTimeMerger[tuple[Decoded, Record]] | None = None,
                 metrics: WorkerMetrics | None = None,
                 perf_s: SecondsClock = time.perf_counter,
                 write_stall_s: float = 5.0) -> None:
        """`write_stall_s`: readiness fails while a write has waited this long for storage
        (time from the progress clock)."""
        self.router = router
        self.sink = sink
        self.progress = progress
        self.metrics = metrics if metrics is not None else WorkerMetrics(time.time_ns)
        self.perf_s = perf_s  # times the detectors' work per message (a metric, no decision)
        self.merger = merger if merger is not None else EventTimeMerger(
            ORDERED_TOPICS, progress.now)
        self._ordered = frozenset(self.merger.topics)
        self.stats = PipelineStats()
        self.storage_ok = True
        self.write_stall_s = write_stall_s
        self._writing_since: float | None = None  # progress clock, while a write is out
        # Per topic-partition: every offset up to this one was fully handled (dispatched or
        # dead-lettered); set at a rebalance, so re-delivered records are skipped.
        self._handled_upto: dict[tuple[str, int], int] = {}

    def _has_more(self, topic: str, partition: int) -> bool:
        return self.progress.lag((topic, partition)) > 0

    # ---- records --------------------------------------------------------------------------
    def on_records(self, records: Iterable[Record], limit: int | None = None) -> BatchResult:
        """Route a batch. Call `flush()` before acking the batch and `result.finished`.

        The event-time merge hands over at most `limit` records (None: all it may): the
        worker passes what one turn of its loop can take and releases the rest with
        `on_held`.
        """
        result = BatchResult()
        records = list(records)
        self.stats.batches += 1
        assigned = self.progress.assignment
        batch: set[int] = set()
        for r in records:
            tp = (r.topic, r.partition)
            if assigned and tp not in assigned:
                # Revoked while the batch was in flight: its new owner re-reads it.
                self.stats.skipped_not_assigned += 1
                continue
            self.progress.processed(r.topic, r.partition, r.offset)
            if r.offset <= self._handled_upto.get(tp, -1):
                self.stats.skipped_redelivered += 1  # handled before the rebalance
                continue
            self.stats.records += 1
            self.metrics.messages[r.topic] += 1
            d = self.router.decode(r.topic, r.partition, r.offset, r.key, r.value)
            if not isinstance(d, Decoded):
                self._collect(d, r, result)
            elif r.topic in self._ordered:
                self.merger.push(r.partition, d.job, r.topic, d.time_ns, (d, r))
                batch.add(id(r))
            else:
                self._dispatch(d, r, result)  # a heartbeat: no order to keep
        for d, r in self._release(limit):
            if id(r) in batch:
                batch.discard(id(r))
            else:
                result.finished.append(r.ref)
            self._dispatch(d, r, result)
        if batch:
            result.held = [r.ref for r in records if id(r) in batch]
        return result

    def _release(self, limit: int | None) -> list[tuple[Decoded, Record]]:
        return self.merger.release(self._has_more, limit)

    def on_held(self, limit: int | None = None) -> BatchResult:
        """Dispatch what the merge may release now, at most `limit` records (one call's
        worth): a caller loops until it finishes nothing, handing its event loop back in
        between, so a topic that catches up never holds the loop for all it frees at once."""
        result = BatchResult()
        for d, r in self._release(limit):
            result.finished.append(r.ref)
            self._dispatch(d, r, result)
        return result

    def _dispatch(self, d: Decoded, r: Record, result: BatchResult) -> None:
        self.metrics.event_time(d.topic, d.time_ns)
        t0 = self.perf_s()
        routed = self.router.dispatch(d)
        if routed.output.reports:
            self.metrics.observe_diagnosis(self.perf_s() - t0, len(routed.output.reports))
        self._collect(routed, r, result)

    def _collect(self, routed: Routed, r: Record, result: BatchResult) -> None:
        """Store and publish what one message produced (its output, or its dead letter)."""
        if routed.dead_letter is not None:
            self.sink.add_dead_letter(routed.dead_letter)
            key = r.key if r.key is not None else (routed.job or "").encode()
            result.outgoing.append(Outgoing(DEADLETTER, key, _encode(routed.dead_letter)))
        else:
            self._emit(routed.output, result)

    def _emit(self, out: DiagnoserOutput, result: BatchResult) -> None:
        if not out.reports and not out.incidents:
            return
        self.sink.add_output(out)
        self.stats.reports += len(out.reports)
        result.outgoing.extend(self._incident(inc) for inc in out.incidents)
        result.incidents.extend(out.incidents)

    def _incident(self, inc: IncidentV1) -> Outgoing:
        self.stats.incidents += 1
        self.metrics.incident(inc)
        return Outgoing(INCIDENTS, inc.job.encode("utf-8"), _encode(inc))

    def rebuild(self, history: Iterable[Record]) -> int:
        """Rebuild the state of the jobs in `history` (messages a previous owner of their
        partitions already processed), discarding what the diagnosers emit: it was stored
        and published then. Returns how many messages were replayed."""
        merger: EventTimeMerger[Decoded] = EventTimeMerger(self.merger.topics, self.progress.now)
        replayed: list[Decoded] = []
        for r in history:
            d = self.router.decode(r.topic, r.partition, r.offset, r.key, r.value, count=False)
            if not isinstance(d, Decoded):
                continue
            if r.topic in self._ordered:
                merger.push(r.partition, d.job, r.topic, d.time_ns, d)
            else:
                replayed.append(d)
                self.router.dispatch(d, count=False)
        ordered = merger.release(lambda _t, _p: False)
        for d in ordered:
            self.router.dispatch(d, count=False)
        replayed += ordered
        self.stats.rebuilt += len(replayed)
        return len(replayed)

    # ---- time and ownership ---------------------------------------------------------------
    def ticks(self, limit: int | None = None) -> Iterator[BatchResult]:
        """Release what the merge held (at most `limit` records), then let time pass for
        caught-up partitions (grace periods, hang timeouts, idle jobs), one job per item, so
        the caller can hand its loop back in between (with a thousand jobs in flight a tick
        took 0.6 s)."""
        yield self.on_held(limit)
        held = self.merger.partitions_with_items()
        quiet = [p for p in self.progress.caught_up_partitions() if p not in held]
        for out in self.router.tick_each(quiet):
            result = BatchResult()
            self._emit(out, result)
            yield result

    def on_revoked(self, tps: Iterable[tuple[str, int]]) -> None:
        """A rebalance starts: forget what the merge still holds (those records were never
        acked, so they come again) and remember, per topic-partition, up to which offset
        everything was handled, since the consumer will re-deliver from its last commit.

        Diagnoser state is kept: most partitions come back to the same worker, and their
        re-delivered records are then skipped instead of being diagnosed twice.
        """
        tps = set(tps)
        first_held: dict[tuple[str, int], int] = {}
        for _d, r in self.merger.drop({p for _t, p in tps}):
            key = (r.topic, r.partition)
            first_held[key] = min(first_held.get(key, r.offset), r.offset)
        for tp in tps:
            done = first_held[tp] - 1 if tp in first_held else self.progress.received(tp)
            if done >= 0:
                self._handled_upto[tp] = done

    def on_assigned(self, tps: Iterable[tuple[str, int]]) -> set[int]:
        """The new assignment; returns the partition numbers that are new to this worker
        (their jobs' state must be rebuilt). State of partitions gone elsewhere is dropped."""
        new = set(tps)
        before = {p for _t, p in self.progress.assignment}
        now = {p for _t, p in new}
        gone = before - now
        if gone:
            dropped = self.router.revoke(gone)
            self.merger.drop(gone)
            for tp in [tp for tp in self._handled_upto if tp[1] in gone]:
                del self._handled_upto[tp]
            if dropped:
                log.info("partitions %s moved away: dropped the state of %d job(s)",
                         sorted(gone), len(dropped))
        self.progress.assigned(new)
        return now - before

    # ---- storage --------------------------------------------------------------------------
    # A write is taken (`begin_write`), written (`PendingRows.write`, on any one thread) and
    # settled (`end_write`), so the worker can write on a thread while its loop goes on:
    # rows added meanwhile wait in the sink for the next write. One write at a time, each
    # settled before the next is taken; then a write that succeeds has stored every row
    # added before it began, which is what acking after it relies on.

    @property
    def buffer_full(self) -> bool:
        """The sink holds as many rows as it should: write them before adding more."""
        return self.sink.full

    def begin_write(self) -> PendingRows:
        """Take every buffered row for one write; call `end_write` when it returned."""
        if self._writing_since is not None:
            raise RuntimeError("a write is already out: settle it before taking another")
        self._writing_since = self.progress.now()
        return self.sink.take()

    def end_write(self, rows: PendingRows, error: BaseException | None) -> bool:
        """Settle a write: True if every row was stored. A StorageError keeps the rows not
        written for the next write and fails readiness until a write succeeds; any other
        error (a bug) keeps them too, and is raised."""
        from storage.client import StorageError

        self._writing_since = None
        rows.settle(stored=error is None)
        if error is None:
            if not self.storage_ok:
                log.warning("ClickHouse writes work again")
            self.storage_ok = True
            return True
        if not isinstance(error, StorageError):
            raise error
        self.stats.storage_failures += 1
        self.stats.last_storage_error = str(error)
        if self.storage_ok:
            log.error("ClickHouse write failed (will retry): %s", error)
        self.storage_ok = False
        return False

    def flush(self) -> bool:
        """Write buffered rows on this thread; False (rows kept for the next try) if storage
        failed. (The worker writes on a thread of its own instead: `streams.storing`.)"""
        rows = self.begin_write()
        try:
            rows.write()
        except Exception as exc:
            return self.end_write(rows, exc)
        return self.end_write(rows, None)

    def writing_s(self) -> float:
        """How long the write out now has waited (0 when none is)."""
        since = self._writing_since
        return 0.0 if since is None else max(0.0, self.progress.now() - since)

    def readiness(self) -> Readiness:
        if not self.storage_ok:
            return Readiness(False, f"storage: {self.stats.last_storage_error}")
        waited = self.writing_s()
        if waited >= self.write_stall_s:
            return Readiness(False, f"storage: a write to ClickHouse has waited {waited:.0f} s "
                             f"for an answer (ready again once one is stored)")
        return self.progress.readiness()

    def metrics_text(self) -> str:
        """This worker's Prometheus page (`streams.metrics`)."""
        return self.metrics.render(
            lag={tp: self.progress.lag(tp) for tp in self.progress.assignment},
            dead_letters=dict(self.router.dead_letters.by_cause),
            jobs=len(self.router.jobs()), storage_ok=self.storage_ok)

    def snapshot(self) -> dict[str, object]:
        """Counters for logs and the API: lag, dead letters, throughput."""
        dec = self.router.steps_decoder
        return {
            "records": self.stats.records,
            "batches": self.stats.batches,
            "reports": self.stats.reports,
            "incident_events": self.stats.incidents,
            "dead_letters": self.router.dead_letters.as_dict(),
            "jobs": len(self.router.jobs()),
            "held_for_order": self.merger.buffered,
            "forced_order_releases": self.merger.forced,
            "forced_order_releases_waiting_on": dict(self.merger.forced_by_topic),
            "steps_decoder": {"cached_ranks": len(dec), "hits": dec.hits, "misses": dec.misses,
                              "fallbacks": dec.fallbacks},
            "storage_ok": self.storage_ok,
            "storage_failures": self.stats.storage_failures,
            "storage_writing_s": round(self.writing_s(), 3),
            "rebuilt_from_history": self.stats.rebuilt,
            "skipped_redelivered": self.stats.skipped_redelivered,
            **self.progress.snapshot(),
        }


def build_pipeline(
    sink: RowSink,
    make_diagnoser: Callable[[str], Diagnoser],
    *,
    max_message_bytes: int,
    stall_after_s: float,
    job_idle_s: float,
    now_s: SecondsClock,
    decoder_cache_ranks: int = 16_384,
    wall_ns: NanoClock = time.time_ns,
    version: str = "",
    write_stall_s: float = 5.0,
) -> Pipeline:
    """Wire a pipeline from its parts with one clock (seconds; the router gets ns), and the
    wall clock its metrics measure event-time lag against."""
    router = JobRouter(
        make_diagnoser,
        max_message_bytes=max_message_bytes,
        now_ns=lambda: int(now_s() * NS_PER_S),
        idle_evict_s=job_idle_s,
        decoder_max_ranks=decoder_cache_ranks,
    )
    return Pipeline(router, sink, Progress(now_s, stall_after_s),
                    metrics=WorkerMetrics(wall_ns, version), write_stall_s=write_stall_s)
