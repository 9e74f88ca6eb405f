"""streams.storing: the worker's writes run on a thread of their own while its loop serves
the probes, and nothing is acked before the write that stores its rows has returned.

The store is `MemoryStore` behind a gate: each write waits on the gate, on whatever thread
runs it, so a test holds a write "hung" for as long as it likes and looks at the loop
meanwhile. Time is a fake clock; nothing here waits on the wall clock except the gate's
deadlock guard, which fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from flare.commands.worker import build_api
from schemas.testing import FakeClock
from schemas.topics import STEPS
from storage.client import StorageError
from storage.testing import MemoryRows, MemoryStore
from streams.pipeline import Pipeline, Record, build_pipeline
from streams.storing import Storer

GUARD_S = 30.0  # a gate never opened fails the test after this, instead of hanging it


class GatedRows:
    """A write of `GatedStore`: waits at the gate, then stores as `MemoryRows` does."""

    def __init__(self, store: GatedStore, rows: MemoryRows) -> None:
        self.store, self.rows = store, rows

    def write(self) -> dict[str, int]:
        store = self.store
        with store.count_lock:
            store.writing += 1
            store.most_at_once = max(store.most_at_once, store.writing)
            store.threads.add(threading.get_ident())
            store.batches.append([item.offset for item in self.rows.items])  # type: ignore[union-attr]
        store.entered.release()
        try:
            if not store.gate.wait(GUARD_S):
                raise AssertionError("the write was never let through")
            return self.rows.write()
        finally:
            with store.count_lock:
                store.writing -= 1

    def settle(self, *, stored: bool) -> None:
        self.rows.settle(stored=stored)


class GatedStore(MemoryStore):
    """A MemoryStore whose writes wait until `gate` is set (dead letters only, in tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)  # released once per write that began
        self.count_lock = threading.Lock()
        self.writing = 0
        self.most_at_once = 0
        self.threads: set[int] = set()
        self.batches: list[list[int]] = []  # the offsets of each write's dead letters

    def take(self) -> GatedRows:  # type: ignore[override]
        return GatedRows(self, super().take())


def make_pipeline(store: MemoryStore, clock: FakeClock) -> Pipeline:
    pipe = build_pipeline(store, lambda job: pytest.fail("no job is diagnosed here"),
                          max_message_bytes=1 << 20, stall_after_s=30.0, job_idle_s=600.0,
                          now_s=clock.seconds, write_stall_s=5.0)
    pipe.on_assigned([(STEPS, 0)])
    return pipe


def bad_record(offset: int) -> Record:
    """A record the pipeline dead-letters: one row for the sink."""
    return Record(STEPS, 0, offset, b"j", b"not json", ref=f"m{offset}")


def stored_offsets(store: MemoryStore) -> list[int]:
    return [item.offset for item in store.stored]  # type: ignore[union-attr]


async def began(store: GatedStore) -> None:
    """Until a write has begun on its thread (waiting off the loop, so the loop may run it)."""
    assert await asyncio.to_thread(store.entered.acquire, True, GUARD_S)


def never() -> bool:
    return False


def test_the_probes_answer_while_a_write_hangs_and_nothing_is_acked_before_it_returns(
) -> None:
    store, clock = GatedStore(), FakeClock()
    pipe = make_pipeline(store, clock)
    pipe.on_records([bad_record(0), bad_record(1)])
    acked: list[Any] = []

    async def scenario() -> None:
        storer = Storer(pipe, retry_s=1.0)
        transport = httpx.ASGITransport(app=build_api(MemoryStore(), pipe))
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as api:
            batch = asyncio.create_task(
                storer.store_then_ack(["m0", "m1"], acked.append, never))
            await began(store)
            # The write is out, on another thread; the loop serves the worker's API.
            assert (await api.get("/livez")).status_code == 200
            assert (await api.get("/readyz")).status_code == 200  # not stalled long yet
            clock.advance(6.0)
            ready = await api.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["detail"].startswith(
                "storage: a write to ClickHouse has waited 6 s")
            assert (await api.get("/livez")).status_code == 200
            assert pipe.snapshot()["storage_writing_s"] == 6.0
            assert acked == [] and store.stored == [] and not batch.done()

            store.gate.set()  # ClickHouse answers
            assert await batch
            assert acked == ["m0", "m1"] and stored_offsets(store) == [0, 1]
            assert (await api.get("/readyz")).status_code == 200
        storer.close()

    asyncio.run(scenario())
    assert threading.get_ident() not in store.threads  # never written on the loop's thread


def test_rows_added_while_a_write_is_out_wait_for_the_next_write_one_write_at_a_time(
) -> None:
    store, clock = GatedStore(), FakeClock()
    pipe = make_pipeline(store, clock)
    pipe.on_records([bad_record(0)])
    acked: list[Any] = []

    async def scenario() -> None:
        storer = Storer(pipe, retry_s=1.0)
        first = asyncio.create_task(storer.store_then_ack(["m0"], acked.append, never))
        await began(store)
        pipe.on_records([bad_record(1)])  # on the loop, while the first write is out
        second = asyncio.create_task(storer.store_then_ack(["m1"], acked.append, never))
        for _ in range(10):
            await asyncio.sleep(0)
        assert store.batches == [[0]] and acked == []  # the second waits for the first
        store.gate.set()
        assert await first and await second
        storer.close()

    asyncio.run(scenario())
    assert store.batches == [[0], [1]] and store.most_at_once == 1
    assert acked == ["m0", "m1"] and stored_offsets(store) == [0, 1]


def test_a_failed_write_acks_nothing_and_its_rows_go_first_in_the_write_that_stores_them(
) -> None:
    store, clock = MemoryStore(), FakeClock()
    pipe = make_pipeline(store, clock)
    pipe.on_records([bad_record(0)])
    store.fail = True
    acked: list[Any] = []
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        """The back-off, without waiting: ClickHouse is back after the second failure, and
        the loop added a row meanwhile."""
        waits.append(seconds)
        assert acked == [] and not pipe.readiness().ready
        assert pipe.readiness().reason.startswith("storage: ClickHouse at memory")
        if len(waits) == 2:
            pipe.on_records([bad_record(1)])
            store.fail = False

    async def scenario() -> bool:
        return await Storer(pipe, retry_s=1.0, sleep=sleep).store_then_ack(
            ["m0"], acked.append, never)

    assert asyncio.run(scenario())
    assert waits == [1.0, 1.0] and pipe.stats.storage_failures == 2
    assert acked == ["m0"] and stored_offsets(store) == [0, 1] and pipe.readiness().ready


def test_stopping_while_storage_fails_acks_nothing_and_keeps_the_rows() -> None:
    store, clock = MemoryStore(), FakeClock()
    pipe = make_pipeline(store, clock)
    pipe.on_records([bad_record(0)])
    store.fail = True
    acked: list[Any] = []

    async def scenario() -> bool:
        return await Storer(pipe, retry_s=1.0).store_then_ack(["m0"], acked.append,
                                                              lambda: True)

    assert not asyncio.run(scenario())
    assert acked == [] and len(store.buffered) == 1 and store.stored == []


def test_a_caller_cancelled_while_its_write_is_out_does_not_abandon_it() -> None:
    """The next write waits for the cancelled caller's, which still stores its rows: a
    later ack never overtakes rows still on the wire."""
    store, clock = GatedStore(), FakeClock()
    pipe = make_pipeline(store, clock)
    pipe.on_records([bad_record(0)])
    acked: list[Any] = []

    async def scenario() -> None:
        storer = Storer(pipe, retry_s=1.0)
        gone = asyncio.create_task(storer.store_then_ack(["m0"], acked.append, never))
        await began(store)
        gone.cancel()
        pipe.on_records([bad_record(1)])
        later = asyncio.create_task(storer.store_then_ack(["m1"], acked.append, never))
        for _ in range(10):
            await asyncio.sleep(0)
        assert store.batches == [[0]]
        store.gate.set()
        assert await later
        with pytest.raises(asyncio.CancelledError):
            await gone
        storer.close()

    asyncio.run(scenario())
    assert store.batches == [[0], [1]] and stored_offsets(store) == [0, 1]
    assert acked == ["m1"] and pipe.writing_s() == 0.0


@pytest.mark.parametrize("make_error", [lambda: StorageError("down"), lambda: KeyError("bug")])
def test_a_write_that_raises_hands_its_rows_back(make_error: Callable[[], Exception]) -> None:
    """A storage failure is counted and retried later; any other error (a bug) is raised to
    the caller, whose batch then stays un-acked; either way the rows are back in the sink."""
    store, clock = MemoryStore(), FakeClock()
    pipe = make_pipeline(store, clock)
    pipe.on_records([bad_record(0)])
    error = make_error()

    def raising_take() -> Any:
        rows = MemoryStore.take(store)

        class Raising:
            def write(self) -> None:
                raise error

            def settle(self, *, stored: bool) -> None:
                rows.settle(stored=stored)

        return Raising()

    store.take = raising_take  # type: ignore[method-assign]

    async def scenario() -> bool:
        return await Storer(pipe, retry_s=1.0).write()

    if isinstance(error, StorageError):
        assert not asyncio.run(scenario())
        assert pipe.stats.storage_failures == 1
    else:
        with pytest.raises(KeyError):
            asyncio.run(scenario())
    assert len(store.buffered) == 1 and pipe.writing_s() == 0.0


def test_a_stopping_worker_leaves_a_hung_last_write_unacked_after_its_bound() -> None:
    """The store does not answer: the last write gives up after its bound with nothing
    acked or stored (a worker that exits then leaves those records to the next owner)."""
    store, clock = GatedStore(), FakeClock()
    pipe = make_pipeline(store, clock)
    pipe.on_records([bad_record(0)])
    acked: list[Any] = []

    async def scenario() -> bool:
        storer = Storer(pipe, retry_s=1.0)
        out = asyncio.create_task(storer.store_then_ack(["m0"], acked.append, never))
        await began(store)
        stored = await storer.last_write(0.05)  # loop time: the gate stays shut
        assert not out.done() and acked == [] and store.stored == []
        store.gate.set()  # let the thread end (the test's own cleanup)
        await out
        storer.close()
        return stored

    assert asyncio.run(scenario()) is False
    assert acked == ["m0"]  # the write the batch was waiting on did finish afterwards


def test_the_last_write_stores_what_is_buffered_when_the_store_answers() -> None:
    store, clock = MemoryStore(), FakeClock()
    pipe = make_pipeline(store, clock)
    pipe.on_records([bad_record(0), bad_record(1)])

    async def scenario() -> bool:
        storer = Storer(pipe, retry_s=1.0)
        try:
            return await storer.last_write(30.0)
        finally:
            storer.close()

    assert asyncio.run(scenario()) is True
    assert stored_offsets(store) == [0, 1]


def test_a_write_hung_on_the_write_thread_does_not_hold_the_process_exit() -> None:
    """With the executor's threads (joined at exit) this child would hang forever; the
    write thread is a daemon, so the child exits at once with its write still blocked."""
    import subprocess
    import sys

    child = (
        "import threading\n"
        "from streams.storing import WriteThread\n"
        "t = WriteThread('flare-store')\n"
        "t.submit(threading.Event().wait)\n"  # a write that never returns
        "print('leaving')\n"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=GUARD_S)
    assert done.returncode == 0 and done.stdout.strip() == "leaving", done.stderr
