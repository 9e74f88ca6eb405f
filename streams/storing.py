"""The worker's writes to storage, off its event loop, then its acks.

The worker's loop also serves `/livez`, `/readyz`, `/metrics` and the consumer's ticks. A
ClickHouse that accepts and never answers, or a host that drops packets, holds a write for
the client's timeouts (FLARE_CLICKHOUSE_*_TIMEOUT_S), so a write on the loop made the worker
look dead to its orchestrator for that long, again at every retry. Here the loop only takes
the rows (`Pipeline.begin_write`) and settles the write (`Pipeline.end_write`); the INSERTs
run on a thread of their own, and the loop goes on meanwhile, adding rows to fresh buffers.

What keeps acks safe: writes go one at a time (an asyncio lock, held from taking the rows
to settling them), and a failed write's rows go back in the sink before the lock is let go.
So a write that succeeds has stored every row added before it took its rows: acking after it
never acks a record whose rows are not stored. A caller cancelled while its write is out
does not abandon it: the write runs in a task of its own that settles it (its rows stored,
or back in the sink) before the next one starts.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

from streams.pipeline import Pipeline

log = logging.getLogger(__name__)
T = TypeVar("T")


class WriteThread:
    """One daemon thread that runs the calls submitted to it, in order.

    Not a `ThreadPoolExecutor`: Python joins those threads when the process exits, so a write
    hung on a store that never answers would hold a stopping worker for the client's
    timeouts (43 s with the defaults, measured), past an orchestrator's grace period. A
    daemon thread is left behind instead: the worker has not acked that write's records, so
    the partitions' next owner reads them again.

    >>> t = WriteThread("example")
    >>> t.submit(lambda: 6 * 7).result(timeout=5)
    42
    >>> t.shutdown()
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((call, future))
        return future

    def shutdown(self) -> None:
        """End the thread once the calls submitted before are done."""
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # handed to the waiting coroutine
                future.set_exception(exc)


class Storer:
    """Writes the pipeline's rows on one thread of its own; built and used on one loop."""

    def __init__(self, pipeline: Pipeline, *, retry_s: float,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        """`retry_s`: back-off between failed writes (the caller's batch stays un-acked);
        `sleep` waits it out (a test passes one that does not wait)."""
        self.pipeline = pipeline
        self.retry_s = retry_s
        self._sleep = sleep
        self._lock = asyncio.Lock()
        # One thread: writes are serialized by the lock anyway, and a hung write must not
        # take the loop's default executor (the API's and the clients' threads) with it.
        self._thread = WriteThread("flare-store")
        self._writes: set[asyncio.Task[bool]] = set()

    async def write(self) -> bool:
        """One write of every row buffered now (and of any a write before it handed back);
        True once stored, False on a storage failure (the rows kept for the next write)."""
        task = asyncio.ensure_future(self._write())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return await asyncio.shield(task)

    def write_soon(self) -> None:
        """Start a write and do not wait for it (a rebalance must not wait on ClickHouse);
        a failure is only logged: the next write takes the rows again."""
        task = asyncio.ensure_future(self._write())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        task.add_done_callback(_log_failure)

    async def until_stored(self, stopping: Callable[[], bool]) -> bool:
        """Write until stored, every `retry_s`; False if `stopping()` first (nothing stored
        then: the caller must not ack)."""
        while not await self.write():
            if stopping():
                return False
            await self._sleep(self.retry_s)
        return True

    async def store_then_ack(self, messages: Iterable[Any], ack: Callable[[Any], None],
                             stopping: Callable[[], bool]) -> bool:
        """Ack `messages` once every row buffered now is stored; none if `stopping()` first.
        Returns whether they were acked."""
        if not await self.until_stored(stopping):
            return False
        for message in messages:
            ack(message)
        return True

    async def last_write(self, within_s: float) -> bool:
        """The write out, if any, then one of every row still buffered, both within
        `within_s` (a stopping worker's): True once stored. Past it, False and the rows are
        left unwritten: their records are not acked, so the next owner reads them again."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.write()), within_s)
        except TimeoutError:
            log.warning("storage did not answer the last write within %.0f s: its records "
                        "are not acked, and are read again by the partitions' next owner",
                        within_s)
            return False

    async def _write(self) -> bool:
        async with self._lock:
            rows = self.pipeline.begin_write()
            try:
                await asyncio.wrap_future(self._thread.submit(rows.write))
            except Exception as exc:  # StorageError: kept and retried; anything else raised
                return self.pipeline.end_write(rows, exc)
            return self.pipeline.end_write(rows, None)

    def close(self) -> None:
        """Let the write thread end once its write is done (no new writes after this)."""
        self._thread.shutdown()


def _log_failure(task: asyncio.Task[bool]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("a write to storage failed", exc_info=exc)
