"""The faust-streaming worker: Kafka in, `Pipeline` in the middle, ClickHouse and Kafka out.

Only the faust wiring lives here; the per-record logic is in `pipeline.py` (pure). Choices
that come from measured failure modes (DESIGN §6):
- the three input topics are consumed in whole fetched batches, handed over by the consumer
  itself (`kafka/faust_consumer.py`: faust's per-event machinery was a quarter of the main
  thread at 16,384 GPUs); a record is acked only after its rows are in ClickHouse, so a
  committed offset never has rows still in memory;
- the rows are written on a thread of their own (`storing.py`), never on the loop: a
  ClickHouse that does not answer holds that thread for the client's timeouts, while the
  loop keeps serving the probes (and `/readyz` says storage is stuck);
- everything in a batch's handling is caught (an exception there must not stop the
  consumer) and a watchdog on the age of the last processed offset fails `/readyz`;
- the loop is handed back about every 25 ms of work (`pacing.py`): the API and the probes
  are served from it;
- detector state is plain objects per partition, not faust tables (no changelog topics);
- short session timeout (tansu joins a group in about half of it);
- the API, when served here, runs on the worker's own loop (`faust.contrib.asgi`), because
  with embedded chDB one process owns the data directory.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any

from schemas.kafka import KafkaConnection
from schemas.topics import DEADLETTER, INCIDENTS, INPUT_TOPICS
from schemas.wire import IncidentV1
from streams.alerts import Notifier
from streams.pacing import TurnBudget
from streams.pipeline import BATCH_MAX, BatchResult, Outgoing, Pipeline, Record
from streams.rebuild import rebuild_partitions
from streams.storing import Storer

log = logging.getLogger(__name__)

TICK_S = 1.0  # how often time passes for quiet jobs and lag is sampled
TURN_S = 0.025  # work per turn of the event loop, about (`pacing.py`)
STATS_EVERY_S = 30.0
RETRY_S = 1.0  # back-off while ClickHouse refuses writes (the batch stays un-acked)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """How one worker consumes: plain values the CLI takes from its settings (the stream
    code reads no environment), so a test builds a worker without any."""

    group_id: str  # the consumer group the workers share
    partitions: int  # of the topics faust declares (they are created beforehand)
    max_message_bytes: int  # sizes the fetches and the producer's requests
    session_timeout_s: float  # consumer-group session: tansu joins in about half of it
    fetch_max_wait_ms: int  # longest a fetch waits on quiet partitions (faust's own: 1,500)
    rebuild_messages: int  # history re-read per input topic-partition on assignment (0: none)
    shutdown_write_s: float = 10.0  # a stopping worker's wait for its last write, at most


@dataclass(frozen=True, slots=True)
class ApiServer:
    """An ASGI app to serve from the worker's loop."""

    asgi_app: Any
    host: str
    port: int


def build_app(
    config: WorkerConfig,
    conn: KafkaConnection,
    pipeline: Pipeline,
    *,
    datadir: Path,
    api: ApiServer | None = None,
    notifier: Notifier | None = None,
) -> Any:
    """The faust App of one worker, with its agent, timer and rebalance hooks.

    `datadir` is faust's own scratch directory (it keeps no state there for us: no tables);
    the caller gives a temporary one so nothing lands in the working directory. Partitions
    new to this worker have their recent history re-read from the cluster (`rebuild.py`).
    With a `notifier`, emitted incidents are pushed as alerts from a task of their own, in
    order, so a slow or absent Alertmanager never holds up diagnosis.
    """
    import faust
    from faust.contrib.asgi import serve_asgi

    from streams.kafka.faust_connection import faust_broker_urls, faust_credentials
    from streams.kafka.faust_consumer import batch_transport
    from streams.kafka.history import KafkaHistory

    history = KafkaHistory(conn, config.group_id)
    max_fetch = max(4 * 1024 * 1024, 2 * config.max_message_bytes)
    app = faust.App(
        config.group_id,
        broker=faust_broker_urls(conn),
        broker_credentials=faust_credentials(conn),
        key_serializer="raw",
        value_serializer="raw",
        autodiscover=False,
        store="memory://",
        datadir=str(datadir),
        topic_partitions=config.partitions,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=config.session_timeout_s,
        broker_heartbeat_interval=max(0.5, config.session_timeout_s / 6),
        broker_commit_interval=1.0,
        consumer_max_fetch_size=max_fetch,
        producer_max_request_size=max(2 * 1024 * 1024, max_fetch),
        web_enabled=api is not None,
        web_host=api.host if api else "127.0.0.1",
        web_bind=api.host if api else "127.0.0.1",
        web_port=api.port if api else 6066,
        worker_redirect_stdouts=False,
        # Records held by the event-time merge stay un-acked on purpose; waiting for "all
        # acked" at a rebalance would stall it. Our revoke hook drops what is held (it is
        # re-delivered) and skips what was already handled, so nothing needs the wait.
        stream_wait_empty=False,
    )
    out_topics = {
        INCIDENTS: app.topic(INCIDENTS, key_serializer="raw", value_serializer="raw"),
        DEADLETTER: app.topic(DEADLETTER, key_serializer="raw", value_serializer="raw"),
    }

    async def send(outgoing: list[Outgoing]) -> None:
        for o in outgoing:
            await out_topics[o.topic].send(key=o.key, value=o.value)

    storer = Storer(pipeline, retry_s=RETRY_S)

    def stopping() -> bool:
        return bool(app.should_stop)

    async def relieve() -> bool:
        """Write the rows if the sink is full (no ack: that waits for the batch's end), so a
        large batch or tick never holds more than the sink's bound in memory; False if the
        worker is stopping first."""
        return not pipeline.buffer_full or await storer.until_stored(stopping)

    def sample_highwaters() -> None:
        """Each assigned partition's high watermark (for lag) and the mark of its last fetch
        response (for readiness: a broker outage shows no lag, only silence).

        The mark is aiokafka's `last_poll_timestamp`, on the aiokafka consumer faust keeps
        in its consumer thread: private to faust, so read defensively. When no mark can be
        read at all, the broker counts as answering: losing the outage rule is better than
        failing an idle, healthy worker (`tests/unit/streams/test_progress.py` fails if
        either library renames what this relies on)."""
        consumer = app.consumer
        try:
            client: Any = consumer._thread._ensure_consumer()  # type: ignore[attr-defined]
        except Exception:
            client = None  # not started yet, or faust changed
        progress = pipeline.progress
        read = False
        for tp in consumer.assignment():
            try:
                progress.set_highwater(tp.topic, tp.partition, consumer.highwater(tp))
            except Exception:
                pass  # not fetched yet
            try:
                mark = client.last_poll_timestamp(tp)
            except Exception:
                continue  # the assignment changed under us (it lives in another thread)
            progress.fetched(tp.topic, tp.partition, mark)
            read = True
        if not read:
            progress.answered()

    # incident states to alert on, in order; None: time to re-send the open alerts
    alerts: asyncio.Queue[list[IncidentV1] | None] = asyncio.Queue(maxsize=10_000)

    def to_alert(item: list[IncidentV1] | None) -> None:
        if notifier is None or not notifier.targets.enabled:
            return
        try:
            alerts.put_nowait(item)
        except asyncio.QueueFull:
            notifier.stats.failed += len(item or ())

    def ack(message: Any) -> None:
        app.consumer.ack(message)
        pipeline.progress.acked(message.topic, message.partition, message.offset)

    async def finish(result: BatchResult, done: Sequence[Any] = ()) -> None:
        """Store (every row buffered so far), then ack the batch's messages that are `done`
        and those the merge had held and are now processed, then publish."""
        await storer.store_then_ack(chain(done, result.finished), ack, stopping)
        try:
            await send(result.outgoing)
        except Exception:
            log.exception("failed to publish %d incident/dead-letter messages",
                          len(result.outgoing))
        if result.incidents:
            to_alert(result.incidents)

    budget = TurnBudget(TURN_S, BATCH_MAX)
    clock = time.perf_counter

    def call(work: Callable[[], BatchResult], records: int) -> BatchResult | None:
        """One pipeline call, timed into the budget; None if it raised (logged: a bug here
        must not stop the consumer)."""
        t0 = clock()
        try:
            part = work()
        except Exception:
            log.exception("failed to process %d records", records)
            return None
        budget.took(records + len(part.finished), clock() - t0)
        return part

    async def release_held() -> None:
        """What the event-time merge may release now, a turn's worth per call, stored and
        acked together."""
        result = BatchResult()
        while True:
            part = call(partial(pipeline.on_held, budget.records()), 0)
            if part is None or not part.finished:
                break
            result.extend(part)
            if not await relieve():
                return
            await asyncio.sleep(0)
        if result.finished:
            await finish(result)

    async def diagnose(messages: list[Any]) -> None:
        """One fetched batch: stored and acked BATCH_MAX records at a time, diagnosed in
        pipeline calls sized to a turn of the loop (`pacing.py`), with the loop handed back
        after each. A record the event-time merge holds stays un-acked until a later call
        processes it."""
        for i in range(0, len(messages), BATCH_MAX):
            chunk = messages[i:i + BATCH_MAX]
            result = BatchResult()
            sample_highwaters()
            j = 0
            while j < len(chunk):
                n = budget.records()
                records = [Record(m.topic, m.partition, m.offset, m.key, m.value, m)
                           for m in chunk[j:j + n]]
                j += n
                part = call(partial(pipeline.on_records, records, n), len(records))
                if part is not None:
                    result.extend(part)
                if not await relieve():
                    return  # stopping: nothing of this batch is acked
                await asyncio.sleep(0)
            held = {id(m) for m in result.held}
            await finish(result, [m for m in chunk if id(m) not in held] if held else chunk)
        await release_held()

    # The input topics are subscribed through the conductor like an agent's; the consumer
    # hands their records to `diagnose` in whole fetched batches (no agent, no stream).
    app.transport = batch_transport(config.fetch_max_wait_ms, diagnose)(
        app.conf.broker_consumer, app
    )
    app.topics.add(app.topic(*INPUT_TOPICS, key_serializer="raw", value_serializer="raw"))

    last_stats = [time.monotonic()]
    idle_trim = IdleTrim()

    async def tick() -> None:
        try:
            sample_highwaters()
            result = BatchResult()
            turn = clock()
            for part in pipeline.ticks(budget.records()):  # one job at a time
                result.extend(part)
                if not await relieve():
                    return
                if budget.spent(turn, clock()):
                    await asyncio.sleep(0)
                    turn = clock()
            await finish(result)
            await release_held()
            idle_trim.observe(len(pipeline.router.jobs()))
            if time.monotonic() - last_stats[0] >= STATS_EVERY_S:
                last_stats[0] = time.monotonic()
                log.info("flare worker: %s", pipeline.snapshot())
        except Exception:
            log.exception("worker tick failed")

    app.timer(TICK_S, name="flare.worker.tick")(tick)

    if notifier is not None and notifier.targets.enabled:
        async def deliver_alerts() -> None:
            while True:
                item = await alerts.get()
                try:
                    await (notifier.tick() if item is None else notifier.notify(item))
                except Exception:
                    log.exception("alert delivery failed")

        async def resend_alerts() -> None:
            to_alert(None)

        app.task(deliver_alerts)
        app.timer(TICK_S, name="flare.worker.alerts")(resend_alerts)

    async def on_revoked(sender: Any, revoked: Any, **kwargs: Any) -> None:
        # Store what was handled, without holding the rebalance up on ClickHouse: nothing
        # acked depends on this write (acks wait for one of their own), it only stores early
        # the rows of records that, back here after the rebalance, are skipped as handled.
        storer.write_soon()
        pipeline.on_revoked((tp.topic, tp.partition) for tp in revoked)

    async def on_assigned(sender: Any, assigned: Any, **kwargs: Any) -> None:
        try:
            current = app.consumer.assignment()
        except Exception:
            current = assigned
        new = pipeline.on_assigned((tp.topic, tp.partition) for tp in current)
        log.info("assigned partitions %s (new here: %s)",
                 sorted({tp.partition for tp in current}), sorted(new))
        if new and config.rebuild_messages > 0:
            # Deliberately synchronous: no record of these partitions may be processed
            # before their history is replayed, and faust resumes fetching as soon as we
            # yield to the loop. Bounded by rebuild_messages and the read timeout.
            try:
                n = rebuild_partitions(pipeline, history, new,
                                       max_per_tp=config.rebuild_messages)
                if n:
                    log.info("rebuilt the state of partitions %s from %d messages",
                             sorted(new), n)
            except Exception:
                log.exception("could not rebuild partitions %s from history; their jobs "
                              "start from scratch", sorted(new))

    app.on_partitions_revoked.connect(on_revoked)  # type: ignore[arg-type]
    app.on_partitions_assigned.connect(on_assigned)  # type: ignore[arg-type]

    async def on_shutdown(sender: Any, **kwargs: Any) -> None:
        """A last write (of rows whose records are not acked: they are read again anyway),
        after the one out, if any; both within `shutdown_write_s`, so that a store that
        hangs does not hold the stop past an orchestrator's grace period."""
        pipeline.progress.stopping = True
        await storer.last_write(config.shutdown_write_s)

    app.on_before_shutdown.connect(on_shutdown)  # type: ignore[arg-type]

    if api is not None:
        serve_asgi(app, api.asgi_app, host=api.host, port=api.port, log_level="warning")
    return app


def tune_gc() -> None:
    """Fewer, cheaper garbage collections for a process that allocates per message.

    The worker builds a few container objects per consumed message (thousands per second),
    so with CPython's default gen-0 threshold (700) it ran ~30 collections a second and a
    full one every few seconds; those took ~7% of its CPU at 8,192 GPUs. Freezing what
    start-up created (modules, faust, chDB: never garbage) keeps full collections off it,
    and a gen-0 threshold of 10,000 batches the young ones. Cycles are still collected.
    """
    import gc

    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4


def _libc() -> ctypes.CDLL:
    """The C library, whose allocator the worker tunes, trims and reads (OSError without)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def tune_malloc() -> bool:
    """Keep freed memory for the next step instead of handing it back to the kernel (glibc;
    False, nothing changed, elsewhere).

    A 16,384-GPU step is ~14 M ops: its columns and the detectors' temporaries are arrays of
    ~110 MB, allocated and freed every step. glibc serves any block over 32 MB with a fresh
    `mmap` and unmaps it on free, so every step touched ~1.5 GB of new pages, one fault per
    4 KB where the kernel had no huge page to give. In the worker the same array passes cost
    several times what they cost in a young process. Served from the heap and kept there
    (no `mmap`, trimming only past 2 GB of free top), the worker took 16,384 GPUs at 1.52×
    real time instead of 1.31×, side by side (BENCHMARKS.md), at the price of keeping its
    peak while it has jobs: 3.0 GB resident instead of 1.7 GB (`IdleTrim` gives it back
    once none is held).
    """
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def trim_malloc() -> bool:
    """Hand the free memory glibc keeps in its heap back to the kernel (`malloc_trim`;
    False, nothing done, elsewhere). `tune_malloc` keeps freed steps' memory for the next
    steps, which is right while jobs stream in and wasted once none is held."""
    try:
        malloc_trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim(0)
    return True


class IdleTrim:
    """Trim the heap once each time the worker falls idle: it held jobs, and now holds none.

    A worker that took a thousand short jobs, or one 16,384-GPU job, keeps the peak of their
    steps' memory as free heap (`tune_malloc`): 140 MB after a churn of short jobs. Held
    while it has jobs, that memory saves the page faults of the next step; once every job
    is evicted there is no next step to save them for, and an SRE reading the worker's
    resident size after the jobs left should see its baseline, not its peak. Once per idle
    spell: trimming an empty heap every tick would be wasted calls.

    >>> calls = []
    >>> idle = IdleTrim(lambda: calls.append(1) or True)
    >>> [idle.observe(n) for n in (0, 3, 2, 0, 0, 1, 0)], len(calls)
    ([False, False, False, True, False, False, True], 2)
    """

    def __init__(self, trim: Callable[[], bool] = trim_malloc) -> None:
        self._trim = trim
        self._held = False

    def observe(self, jobs_held: int) -> bool:
        """The jobs held now; True when this call trimmed."""
        if jobs_held:
            self._held = True
            return False
        if not self._held:
            return False
        self._held = False
        return self._trim()


def memory_in_use() -> dict[str, float]:
    """What this process's own allocators hold live, apart from what they keep free: MB
    in use and kept free in glibc's heap (numpy's arrays, the broker client; `mallinfo2`,
    glibc ≥ 2.33, else absent) and the blocks CPython's small-object allocator has live
    (Python objects). With `tune_malloc` the heap keeps what a step freed, so the
    resident size stays at its peak; these say whether the memory is still in use (state
    not freed) or only kept. The embedded ClickHouse engine allocates on its own and is
    in neither."""
    out: dict[str, float] = {"python_blocks": float(sys.getallocatedblocks())}
    try:
        mallinfo2 = _libc().mallinfo2
    except (OSError, AttributeError):
        return out
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    mb = 1 / (1 << 20)
    out["heap_in_use_mb"] = (info.uordblks + info.hblkhd) * mb
    out["heap_kept_free_mb"] = info.fordblks * mb
    return out


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (malloc.h): ten size_t fields."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def run_faust(app: Any, *, loglevel: str = "warn", quiet: bool = True) -> None:
    """Run the app until SIGINT/SIGTERM (mode's worker owns the signals and the loop)."""
    from faust.worker import Worker

    tune_gc()
    tune_malloc()

    worker = Worker(app, loglevel=loglevel, quiet=quiet, redirect_stdouts=False)
    worker.execute_from_commandline()
