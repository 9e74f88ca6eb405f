"""The torch.distributed wrappers, in-process on a one-rank gloo group (fast, no spawn)."""

from __future__ import annotations

import pytest

from producers.torch_hook.buffer import END, GROUP, KIND, NAME, NBYTES, SEQ, OpLog
from producers.torch_hook.client import AgentClient
from producers.torch_hook.groups import GroupRegistry
from producers.torch_hook.patch import HookStats, Patcher

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.torch


@pytest.fixture
def patched():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    log = OpLog()
    stats = HookStats()
    groups = GroupRegistry(dist)
    p = Patcher(dist, log, groups, stats)
    p.install()
    try:
        yield log, stats, groups
    finally:
        p.uninstall()
        dist.destroy_process_group()


def _rows(log):
    return [(r[KIND], r[NAME], r[GROUP], r[SEQ], r[NBYTES]) for r in log.rows]


def test_collectives_are_recorded_once_with_group_seq_and_bytes(patched):
    log, stats, _ = patched
    t = torch.ones(16)  # 64 bytes
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    dist.all_gather_into_tensor(torch.empty(16), t)  # calls all_gather_single inside
    dist.all_gather([torch.empty(16)], t)
    dist.reduce_scatter_tensor(torch.empty(16), t)
    dist.all_to_all_single(torch.empty(16), t)
    dist.barrier()
    assert _rows(log) == [
        ("coll", "all_reduce", "world.0", 0, 64),
        ("coll", "broadcast", "world.0", 1, 64),
        ("coll", "all_gather", "world.0", 2, 64),
        ("coll", "all_gather", "world.0", 3, 64),
        ("coll", "reduce_scatter", "world.0", 4, 64),
        ("coll", "all_to_all", "world.0", 5, 64),
        ("coll", "barrier", "world.0", 6, 0),
    ]
    assert all(r[END] >= r[4] for r in log.rows) and not log.pending
    assert stats.hook_errors == 0


def test_async_collective_ends_on_completion(patched):
    log, _, _ = patched
    work = dist.all_reduce(torch.ones(4), async_op=True)
    assert isinstance(work, dist.Work)  # the real Work: a future callback times it
    work.wait()
    work.get_future().wait()
    assert log.rows[0][END] > 0 and not log.pending


def test_tagged_subgroup(patched):
    log, _, groups = patched
    sub = dist.new_group([0])
    assert groups.tag(sub, "tp", 0) == "tp.0"
    dist.all_reduce(torch.ones(2), group=sub)
    dist.all_reduce(torch.ones(2))
    assert _rows(log) == [("coll", "all_reduce", "tp.0", 0, 8),
                          ("coll", "all_reduce", "world.0", 0, 8)]
    assert groups.coords == {"tp": 0}


class BrokenGroups(GroupRegistry):
    def get(self, group):
        raise RuntimeError("boom")


def test_bookkeeping_failure_never_reaches_training():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    stats = HookStats()
    log = OpLog()
    p = Patcher(dist, log, BrokenGroups(dist), stats)
    p.install()
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
        assert stats.hook_errors == 1 and "boom" in stats.first_error
        assert log.rows == [] and not log.pending
    finally:
        p.uninstall()
        dist.destroy_process_group()


def test_torch_errors_still_propagate_and_close_the_op(patched):
    log, _, _ = patched
    with pytest.raises((ValueError, RuntimeError, TypeError)):
        dist.broadcast(torch.ones(2), src=5)  # no such rank
    assert not log.pending


def test_uninstall_restores_torch():
    orig = dist.all_reduce
    p = Patcher(dist, OpLog(), GroupRegistry(dist), HookStats())
    p.install()
    assert dist.all_reduce is not orig and dist.distributed_c10d.all_reduce is not orig
    p.uninstall()
    assert dist.all_reduce is orig and dist.distributed_c10d.all_reduce is orig


def test_daemon_away_drops_and_counts(tmp_path):
    from producers.torch_hook.buffer import RankMeta

    log = OpLog()
    client = AgentClient(tmp_path / "nobody.sock", lambda: RankMeta("j", 0, "n"),
                         log.inflight, interval_s=0.05, retry_s=0.01)
    client.start()
    for _ in range(3):
        assert client.submit(log.cut()) in (True, False)
    client.close(5.0)
    assert client.stats.dropped_steps == 3 and client.stats.sent_steps == 0
