"""Named host stalls on a real torch (CPU): GC, DataLoader waits, checkpoint saves, marked phases.

The hook is installed for real (torch.distributed patched, the sender thread started) with no
daemon to reach and no process group: finished steps wait in the sender's queue, which is
where these tests read them, and build them into messages as the sender would.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from producers import torch_hook
from producers.torch_hook.buffer import (
    BLOCKS,
    END,
    GROUP,
    KIND,
    NAME,
    NBYTES,
    SEQ,
    START,
    OpLog,
    RankMeta,
    encode,
    steps_message,
)
from producers.torch_hook.hook import FlareHook
from producers.torch_hook.patch import HookStats
from producers.torch_hook.stalls import StallPatches
from schemas.decode import decode_steps
from schemas.rankstep import RankStep

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.utils.data.dataloader import _BaseDataLoaderIter  # noqa: E402

META = RankMeta("job-s", 0, "node-s", 0, 1)


@pytest.fixture
def hook(tmp_path: Path) -> Iterator[FlareHook]:
    h = FlareHook(job="job-s", node="node-s", socket_path=tmp_path / "no-daemon.sock",
                  step_on_optimizer=False).install()
    try:
        yield h
    finally:
        h.uninstall(timeout_s=1.0)


def _last_step(hook: FlareHook) -> RankStep:
    """End the step and decode the message the sender would send for it."""
    hook.step()
    return decode_steps(encode(steps_message(META, hook.client._queue[-1], time.time_ns())))


def _named(rows: list[list], name: str) -> list[list]:
    return [r for r in rows if r[NAME] == name]


class CollectsInForward(torch.nn.Module):
    """A forward that collects garbage half-way (as a real one does when its allocations
    cross the collector's threshold)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        gc.collect()
        return self.lin(y)


def test_a_gc_pause_in_a_forward_is_a_host_gc_op_and_leaves_the_forward(hook):
    model = CollectsInForward()
    hook.instrument_module(model)
    model(torch.ones(4, 8)).sum().backward()
    m = _last_step(hook)
    gcs = [i for i, n in enumerate(m.name) if n == "host:gc"]
    fwd = [i for i, n in enumerate(m.name) if n == "fwd"]
    assert gcs and all(m.dur_ns[i] > 0 for i in gcs)
    assert {(int(m.kind[i]), m.group[i], int(m.bytes[i])) for i in gcs} == {(0, "", 0)}  # compute
    fwd_from = int(m.start_ns[fwd[0]])
    fwd_to = int(m.start_ns[fwd[-1]] + m.dur_ns[fwd[-1]])
    inside = [i for i in gcs if fwd_from < m.start_ns[i] < fwd_to]
    assert inside, "the collection ran inside the forward"
    # the forward arrives in pieces around every collection, none overlapping one
    assert len(fwd) >= 2
    for f in fwd:
        for g in gcs:
            f_end, g_end = m.start_ns[f] + m.dur_ns[f], m.start_ns[g] + m.dur_ns[g]
            assert f_end <= m.start_ns[g] or m.start_ns[f] >= g_end
    assert sum(int(m.dur_ns[f]) for f in fwd) <= fwd_to - fwd_from - int(m.dur_ns[inside[0]])


class SlowData(torch.utils.data.Dataset):
    """Eight samples, each 5 ms to fetch: the training thread waits on every batch."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.005)
        return torch.full((2,), float(i))


def test_each_batch_waited_for_is_a_host_data_op(hook):
    batches = list(torch.utils.data.DataLoader(SlowData(), batch_size=2))
    assert len(batches) == 4 and batches[3].tolist() == [[6.0, 6.0], [7.0, 7.0]]
    rows = _named(hook.log.rows, "host:data")
    # one per batch, then the call that ends the epoch (where a loader joins its workers)
    assert len(rows) == len(batches) + 1
    assert all(r[END] - r[START] >= 2 * 5_000_000 for r in rows[:4])  # two samples each
    assert {(r[KIND], r[GROUP], r[SEQ], r[NBYTES], r[BLOCKS]) for r in rows} == {
        ("compute", "", -1, 0, True)}
    m = _last_step(hook)
    assert m.name.count("host:data") == 5


def test_a_torch_save_is_one_host_checkpoint_op(hook, tmp_path: Path):
    torch.save({"w": torch.ones(3)}, tmp_path / "ckpt.pt")
    rows = _named(hook.log.rows, "host:checkpoint")
    assert len(rows) == 1 and rows[0][END] > rows[0][START]
    assert torch.load(tmp_path / "ckpt.pt")["w"].sum().item() == 3.0  # it still saved
    assert _last_step(hook).name.count("host:checkpoint") == 1


def test_a_distributed_checkpoint_save_is_one_stall_however_it_writes(hook, tmp_path: Path):
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert len(_named(hook.log.rows, "host:checkpoint")) == 1
    assert (tmp_path / "dcp" / ".metadata").exists()


def test_saves_beside_training_are_not_stalls_of_the_rank(hook, tmp_path: Path):
    """async_save's writer thread calls torch.save while the rank trains on: only the
    staging, on the training thread, held the rank."""
    writer = threading.Thread(target=torch.save, args=(torch.ones(1), tmp_path / "bg.pt"))
    writer.start()
    writer.join()
    assert _named(hook.log.rows, "host:checkpoint") == [] and (tmp_path / "bg.pt").exists()
    with pytest.warns(UserWarning, match="single process"):
        dcp.async_save({"w": torch.ones(3), "epoch": {"n": 3}}, checkpoint_id=tmp_path / "a",
                       no_dist=True).result()
    assert len(_named(hook.log.rows, "host:checkpoint")) == 1
    assert (tmp_path / "a" / ".metadata").exists()


def test_the_thread_that_ends_steps_is_the_training_thread(hook, tmp_path: Path):
    def train() -> None:
        hook.step()
        torch.save(torch.ones(1), tmp_path / "t.pt")

    trainer = threading.Thread(target=train)
    trainer.start()
    trainer.join()
    assert len(_named(hook.log.rows, "host:checkpoint")) == 1
    torch.save(torch.ones(1), tmp_path / "main.pt")  # the installing thread no longer trains
    assert len(_named(hook.log.rows, "host:checkpoint")) == 1


class CollectsWhenPickled:
    """An object whose pickling runs a collection: a GC pause inside a checkpoint save."""

    def __reduce__(self) -> tuple[type, tuple[int]]:
        gc.collect()
        return (int, (1,))


def test_a_gc_inside_a_save_is_recorded_as_well_as_the_save(hook, tmp_path: Path):
    torch.save({"odd": CollectsWhenPickled()}, tmp_path / "odd.pt")
    (ckpt,) = _named(hook.log.rows, "host:checkpoint")
    inner = [r for r in _named(hook.log.rows, "host:gc") if ckpt[START] <= r[START] < ckpt[END]]
    assert inner and all(r[END] <= ckpt[END] for r in inner)


def test_a_marked_phase_is_a_named_stall_in_flight_while_it_lasts(hook):
    with hook.stall("eval"):
        (row,) = _named(hook.log.rows, "host:eval")
        # in the in-flight table: a long one shows the rank working, not stopped
        assert row[END] < 0 and [(op["name"], op["group"]) for op in
                                 hook.log.inflight()["inflight"]] == [("host:eval", "")]
        time.sleep(0.002)
    assert row[END] - row[START] >= 2_000_000 and row[BLOCKS]
    assert hook.log.inflight()["inflight"] == []
    assert _last_step(hook).name.count("host:eval") == 1


def test_the_module_level_stall_reaches_the_active_hook_only(tmp_path: Path):
    assert torch_hook.stall is torch_hook.hook.stall  # the package is the user API
    with torch_hook.stall("eval"):  # no hook: a no-op
        pass
    hook = torch_hook.install(socket_path=tmp_path / "no-daemon.sock", job="job-s")
    try:
        with torch_hook.stall("eval"):
            pass
        assert [r[NAME] for r in hook.log.rows if r[NAME].startswith("host:e")] == ["host:eval"]
    finally:
        torch_hook.uninstall()
    assert torch_hook.active() is None


def test_gc_callbacks_never_raise_and_ignore_a_stop_without_its_start():
    log, stats = OpLog(), HookStats()
    patches = StallPatches(log, stats)
    patches._on_gc("stop", {"generation": 0})  # installed during a collection
    assert log.rows == []
    # a collection run by another thread is recorded all the same
    worker = threading.Thread(target=lambda: (patches._on_gc("start", {"generation": 2}),
                                              patches._on_gc("stop", {"generation": 2})))
    worker.start()
    worker.join()
    assert [r[NAME] for r in log.rows] == ["host:gc"] and not log.pending

    def broken_clock() -> int:
        raise OSError("no clock")

    log.clock = broken_clock
    patches._on_gc("start", {"generation": 0})  # must not raise into the interpreter
    assert stats.hook_errors == 1 and stats.first_error == "OSError: no clock"


def test_a_lost_stop_ends_the_open_collection_instead_of_leaving_it_in_flight():
    log = OpLog()
    patches = StallPatches(log, HookStats())
    patches._on_gc("start", {"generation": 0})
    patches._on_gc("start", {"generation": 1})
    patches._on_gc("stop", {"generation": 1})
    assert len(log.rows) == 2 and all(r[END] >= r[START] for r in log.rows)
    patches._on_gc("start", {"generation": 2})
    patches.uninstall()  # mid-collection: the row ends now
    assert not log.pending


def test_uninstall_restores_everything_and_records_nothing_more(tmp_path: Path):
    originals = (torch.save, _BaseDataLoaderIter.__next__, dcp.save, dcp.save_state_dict,
                 dcp.async_save)
    callbacks = list(gc.callbacks)
    hook = FlareHook(job="job-s", node="node-s", socket_path=tmp_path / "no-daemon.sock")
    hook.install()
    assert torch.save is not originals[0] and _BaseDataLoaderIter.__next__ is not originals[1]
    assert hook.stalls._on_gc in gc.callbacks
    hook.stalls.install()  # again: nothing is wrapped twice
    assert torch.save.__wrapped__ is originals[0]
    hook.uninstall(timeout_s=1.0)
    assert (torch.save, _BaseDataLoaderIter.__next__, dcp.save, dcp.save_state_dict,
            dcp.async_save) == originals
    assert gc.callbacks == callbacks
    hook.log.cut()
    gc.collect()
    list(torch.utils.data.DataLoader(SlowData(), batch_size=4))
    torch.save(torch.ones(1), tmp_path / "after.pt")
    assert hook.log.rows == []
