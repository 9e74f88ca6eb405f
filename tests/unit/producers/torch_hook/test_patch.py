"""The p2p wrappers (send/recv/isend/irecv/batch_isend_irecv) against a stand-in of torch's
c10d module: gloo cannot send to itself, and these rules need no real transport."""

from __future__ import annotations

from types import SimpleNamespace

from producers.torch_hook.buffer import BLOCKS, END, GROUP, NAME, NBYTES, SEQ, OpLog
from producers.torch_hook.groups import GroupRegistry
from producers.torch_hook.patch import HookStats, Patcher, TimedWork


class Tensor:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class Work:
    def __init__(self) -> None:
        self.done = False

    def wait(self, timeout=None):
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")  # like gloo p2p


class PG:
    group_name = "0"
    group_desc = "default_pg"


def make_c10d(me: int):
    """Functions shaped like torch's, calling each other through the module like torch does."""
    world = PG()
    c10d = SimpleNamespace()

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        return Work()

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        return Work()

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        c10d.isend(tensor, dst, group, tag, group_dst).wait()

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        c10d.irecv(tensor, src, group, tag, group_src).wait()
        return src

    def batch_isend_irecv(ops):
        return [op.op(op.tensor, op.peer, op.group) for op in ops]

    def passthrough(*a, **k):
        return None

    c10d.isend, c10d.irecv, c10d.send, c10d.recv = isend, irecv, send, recv
    c10d.batch_isend_irecv = batch_isend_irecv
    c10d.destroy_process_group = c10d.init_process_group = passthrough
    c10d._get_default_group = lambda: world
    c10d._get_process_group_name = lambda pg: pg.group_name
    dist = SimpleNamespace(distributed_c10d=c10d, get_rank=lambda group=None: me,
                           get_global_rank=lambda pg, r: r)
    for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv"):
        setattr(dist, name, getattr(c10d, name))
    return dist


def install(me: int):
    dist = make_c10d(me)
    log = OpLog()
    p = Patcher(dist, log, GroupRegistry(dist), HookStats())
    p.install()
    return dist, log


def test_send_is_recorded_once_though_it_calls_isend():
    dist, log = install(0)
    dist.send(Tensor(16), 1)
    dist.send(Tensor(16), dst=1)
    dist.recv(Tensor(8), src=1)
    assert [(r[NAME], r[GROUP], r[SEQ], r[NBYTES]) for r in log.rows] == [
        ("send", "world.0.0-1", 0, 16), ("send", "world.0.0-1", 1, 16),
        ("recv", "world.0.1-0", 0, 8)]
    assert not log.pending


def test_both_ends_of_a_transfer_share_group_and_seq():
    d0, log0 = install(0)
    d1, log1 = install(1)
    for _ in range(3):
        d0.send(Tensor(4), 1)
        d1.send(Tensor(4), 0)
        d0.recv(Tensor(4), 1)
        d1.recv(Tensor(4), 0)
    sends0 = [(r[GROUP], r[SEQ]) for r in log0.rows if r[NAME] == "send"]
    recvs1 = [(r[GROUP], r[SEQ]) for r in log1.rows if r[NAME] == "recv"]
    assert sends0 == recvs1 == [("world.0.0-1", i) for i in range(3)]


def test_async_p2p_ends_when_waited_or_seen_complete():
    dist, log = install(0)
    w = dist.isend(Tensor(4), 1)
    r = dist.irecv(Tensor(4), src=1, group=None)
    assert isinstance(w, TimedWork) and len(log.pending) == 2
    assert log.inflight()["inflight"][0]["name"] == "send"
    w.wait()
    r._work.done = True
    assert r.is_completed()
    assert not log.pending and all(row[END] > 0 for row in log.rows)


def test_irecv_from_any_source():
    dist, log = install(2)
    dist.irecv(Tensor(4)).wait()
    assert log.rows[0][GROUP] == "world.0.any-2"


def test_batch_records_each_op_with_its_peer():
    dist, log = install(1)
    ops = [SimpleNamespace(op=dist.isend, tensor=Tensor(4), peer=2, group=None),
           SimpleNamespace(op=dist.irecv, tensor=Tensor(8), peer=0, group=None)]
    reqs = dist.batch_isend_irecv(ops)
    assert [(r[NAME], r[GROUP], r[SEQ], r[NBYTES]) for r in log.rows] == [
        ("send", "world.0.1-2", 0, 4), ("recv", "world.0.0-1", 0, 8)]
    for q in reqs:
        q.wait()
    assert not log.pending


def test_blocking_calls_are_marked_so_the_phase_around_them_excludes_them():
    dist, log = install(0)
    dist.send(Tensor(8), 1)
    work = dist.isend(Tensor(8), 1)
    work.wait()
    assert [(r[NAME], r[BLOCKS]) for r in log.rows] == [("send", True), ("send", False)]
