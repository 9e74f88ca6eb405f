"""Real torch.distributed (gloo) training, 4 processes, through the hook and the node daemon.

The node agent runs in the test process with the in-memory publisher; each rank is a
subprocess (so a hung rank can be killed). What reaches the publisher is decoded with the
worker's own decoders and checked: a rank slowed in its forward shows longer compute and
makes its peers wait in the gradient all-reduce; a rank that stops leaves its peers'
heartbeats showing a collective in flight since the stop; a healthy run has no outlier.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from flare.offline import diagnose_messages
from producers.agent.core import AgentCore
from producers.agent.outbox import Outbox
from producers.agent.server import AgentDaemon
from producers.testing import MemoryPublisher
from schemas.decode import decode_heartbeat, decode_job, decode_steps
from schemas.topics import HEARTBEATS, JOBS, STEPS
from schemas.wire import Layout

torch = pytest.importorskip("torch")
# the tests marked `timed` judge the ranks' timing and run alone in CI; the others (a stopped
# rank, a crash) hold whatever the machine does beside them
pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parents[2]
WORLD = 4


def train(rank: int, world: int, port: int, steps: int, slow_rank: int, slow_s: float,
          stop_rank: int, stop_step: int, stall_rank: int = -1, save_s: float = 0.0) -> None:
    """One rank of a tiny transformer trained with DDP plus tagged tp/dp subgroups.
    `stall_rank` collects garbage inside its forward and marks a 50 ms "eval" each step.
    With `save_s`, rank 0 saves a checkpoint at step 5 with `torch.save` onto storage that
    takes `save_s` seconds to write it."""
    import torch
    import torch.distributed as dist

    from producers import torch_hook

    hook = torch_hook.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp = tp_groups[rank // 2]
    dp = dp_groups[rank % 2]
    hook.tag_group(tp, "tp", rank // 2)
    hook.tag_group(dp, "dp", rank % 2)

    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                             batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=2),
                                torch.nn.Linear(32, 8))
    if rank == slow_rank:
        def slow_forward(_mod, _inp):
            end = time.perf_counter() + slow_s
            a = torch.randn(64, 64)
            while time.perf_counter() < end:
                a = torch.tanh(a @ a)
        model[0].register_forward_pre_hook(slow_forward)
    if rank == stall_rank:
        import gc

        def collect(_mod, _inp) -> None:  # returning anything would replace the input
            gc.collect()

        model[0].register_forward_pre_hook(collect)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hook.instrument_ddp(ddp)
    hook.instrument_module(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(8, 16, 32)
    for step in range(steps):
        if rank == stop_rank and step == stop_step:
            time.sleep(3600)  # "stops inside training": the test kills it
        if rank == 0 and step == 5 and save_s > 0:
            torch.save(model.state_dict(), SlowStorage(save_s))
        if rank == stall_rank:
            with torch_hook.stall("eval"):
                time.sleep(0.05)
        loss = ddp(x).pow(2).mean()
        loss.backward()
        scale = loss.detach().reshape(1)
        dist.all_reduce(scale, group=tp)  # a tp collective every step
        peer = rank ^ 1
        buf = torch.zeros(4)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4), peer, group=tp),
                                       dist.P2POp(dist.irecv, buf, peer, group=tp)])
        for r in reqs:
            r.wait()
        if rank % 2 == 0:  # blocking p2p on the default group, in a deadlock-free order
            dist.send(torch.ones(2), peer)
            dist.recv(buf[:2], peer)
        else:
            dist.recv(buf[:2], peer)
            dist.send(torch.ones(2), peer)
        opt.step()
        opt.zero_grad()
    dist.barrier()
    torch_hook.uninstall()
    dist.destroy_process_group()


class SlowStorage(io.BytesIO):
    """A file on storage that takes `seconds` to write a checkpoint (a busy NFS server)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def write(self, data) -> int:  # type: ignore[no-untyped-def,override]
        if self.seconds > 0:
            time.sleep(self.seconds)
            self.seconds = 0.0
        return super().write(data)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DaemonThread:
    """The node daemon on its own event loop, publishing into memory."""

    def __init__(self, sock: Path, interval_s: float) -> None:
        self.publisher = MemoryPublisher()
        self.daemon = AgentDaemon(AgentCore("node-test"), Outbox(self.publisher, flush_every_s=0.2),
                                  sock, interval_s=interval_s)
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop.run_until_complete(self.daemon.serve(self.stop))

    def __enter__(self) -> DaemonThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.daemon.socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(15)


def launch_ranks(sock: Path, steps: int, *, job: str = "gloo-test", node: str = "node-test",
                 interval_s: float = 0.2, slow_rank: int = -1, slow_s: float = 0.0,
                 stop_rank: int = -1, stop_step: int = -1,
                 stall_rank: int = -1, stacks_after_s: float = 5.0,
                 save_s: float = 0.0) -> list[subprocess.Popen]:
    """Start the WORLD ranks of `train` as job `job` on node `node`, hook on."""
    port = _free_port()
    env = dict(os.environ, FLARE_AGENT_SOCKET=str(sock), FLARE_JOB=job, FLARE_NODE=node,
               FLARE_AGENT_INTERVAL_S=str(interval_s), OMP_NUM_THREADS="1",
               FLARE_STACKS_AFTER_S=str(stacks_after_s),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for rank in range(WORLD):
        code = (f"from tests.integration.test_torch_gloo import train; "
                f"train({rank}, {WORLD}, {port}, {steps}, {slow_rank}, {slow_s}, "
                f"{stop_rank}, {stop_step}, {stall_rank}, {save_s})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO,
                                      env=dict(env, LOCAL_RANK=str(rank))))
    return procs


@pytest.fixture
def sock():
    d = Path(tempfile.mkdtemp(prefix="flare-", dir="/tmp"))
    yield d / "agent.sock"
    shutil.rmtree(d, ignore_errors=True)


def _steps_by_rank(pub: MemoryPublisher):
    out = defaultdict(list)
    for topic, key, value in pub.messages:
        if topic == STEPS:
            assert key == b"gloo-test"
            m = decode_steps(value)
            out[m.rank].append(m)
    return out


def _run_to_end(procs: list[subprocess.Popen], timeout: float = 90) -> None:
    try:
        for p in procs:
            assert p.wait(timeout) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _phase(ms, name: str) -> np.ndarray:
    """Per-step total duration (s) of the ops named `name` of one rank's steps."""
    return np.array([m.dur_ns[[n == name for n in m.name]].sum() / 1e9 for m in ms])


@pytest.mark.timed
def test_slowed_rank_computes_longer_and_peers_wait(sock):
    steps = 8
    with DaemonThread(sock, 0.2) as d:
        _run_to_end(launch_ranks(sock, steps, slow_rank=2, slow_s=0.15))
    by_rank = _steps_by_rank(d.publisher)
    assert sorted(by_rank) == list(range(WORLD))
    for rank, ms in by_rank.items():
        assert [m.step for m in ms] == list(range(steps))
        m = ms[-1]
        assert m.node == "node-test" and m.local_rank == rank
        assert m.coords == {"tp": rank % 2, "dp": rank // 2}
        names = set(m.name)
        assert {"fwd", "bwd", "optimizer", "all_reduce", "send", "recv"} <= names
        groups = set(m.group)
        assert f"tp.{rank // 2}" in groups and "world.0" in groups
    # Skip warm-up steps; compare medians.
    fwd = {r: float(np.median(_phase(ms[2:], "fwd"))) for r, ms in by_rank.items()}
    ar = {r: float(np.median(_phase(ms[2:], "all_reduce"))) for r, ms in by_rank.items()}
    others = [r for r in range(WORLD) if r != 2]
    assert fwd[2] > 0.1 and all(fwd[2] > 3 * fwd[r] for r in others), fwd
    assert all(ar[r] > ar[2] + 0.05 for r in others), ar  # peers wait for rank 2
    # Both ends of a transfer share group and seq.
    def ends(rank: int, name: str) -> set[tuple[str, int]]:
        return {(g, int(q)) for m in by_rank[rank]
                for n, g, q in zip(m.name, m.group, m.seq, strict=True) if n == name}

    sends, recvs = ends(0, "send"), ends(1, "recv")
    assert sends == recvs
    assert {g for g, _s in sends} == {"tp.0.0-1", "world.0.0-1"}
    assert len(sends) == 2 * steps
    jobs = [decode_job(v) for t, _k, v in d.publisher.messages if t == JOBS]
    # the start again once rank 0's groups exist: with the layout they tell
    assert [j.event for j in jobs] == ["start", "start", "end"]
    assert jobs[0].world_size == jobs[1].world_size == WORLD and jobs[0].layout is None
    assert jobs[1].layout == Layout(tp=2, dp=2)
    for t, _k, v in d.publisher.messages:
        if t == HEARTBEATS:
            decode_heartbeat(v)


def test_stopped_rank_leaves_peers_blocked_in_flight(sock):
    with DaemonThread(sock, 0.2) as d:
        procs = launch_ranks(sock, 50, stop_rank=1, stop_step=3)
        try:
            deadline = time.monotonic() + 60
            blocked: dict[int, object] = {}
            last: dict = {}

            def stopped_seen() -> bool:
                # alive with nothing in flight, the stopped rank is published at its
                # keepalive (5 s): wait for the heartbeat that shows the step it stopped in
                return 1 in last and last[1].step == 3

            while time.monotonic() < deadline and (len(blocked) < WORLD - 1
                                                   or not stopped_seen()):
                time.sleep(0.2)
                last = {}
                for t, _k, v in d.publisher.messages:
                    if t == HEARTBEATS:
                        hb = decode_heartbeat(v)
                        last[hb.rank] = hb
                blocked = {r: hb for r, hb in last.items()
                           if hb.inflight and hb.ts_ns - hb.inflight[0].start_ns > 2e9}
        finally:
            for p in procs:
                p.kill()
                p.wait()
    assert sorted(blocked) == [0, 2, 3], blocked
    assert last[1].inflight == [] and last[1].step == 3
    for r in (0, 2, 3):
        assert last[r].step == 3
        assert last[r].inflight[0].name in {"all_reduce", "recv", "send"}


def test_a_hang_shows_where_the_stopped_rank_and_its_waiting_peers_are(sock):
    """Hang forensics: rank 1 stops in its training loop (a sleep, not in any op); every
    rank's hook sends its threads' stacks once its step lasts past the floor, and the hang
    incident merges them: rank 1 alone at the line it stopped on, the others in a
    torch.distributed call."""
    with DaemonThread(sock, 0.2) as d:
        procs = launch_ranks(sock, 50, stop_rank=1, stop_step=3, stacks_after_s=1.0)
        try:
            # the stacks come about a second into the stop, the hang a hang timeout (10 s)
            # of stream time later, with the keepalives that show it
            deadline = time.monotonic() + 60
            hangs: list = []
            while time.monotonic() < deadline and not hangs:
                time.sleep(1.0)
                messages = [(t, v) for t, _k, v in list(d.publisher.messages)]
                hangs = [i for i in diagnose_messages(messages).events
                         if i.kind == "hang" and i.stacks]
        finally:
            for p in procs:
                p.kill()
                p.wait()
    sent = {hb.rank for t, v in messages if t == HEARTBEATS for hb in [decode_heartbeat(v)]
            if hb.stacks}
    assert sent == set(range(WORLD))
    assert hangs, "no hang incident with stacks"
    assert hangs[-1].culprit == "rank:1"
    view = hangs[-1].stacks
    assert view is not None
    lead = view[0]  # the odd one out leads
    assert (lead.thread, lead.ranks, lead.not_ranks) == ("training", "1", "0,2-3")
    assert lead.frames[-1].startswith("test_torch_gloo.py:") and lead.frames[-1].endswith(
        " in train")
    # the peers wait in DDP's gradient all-reduce, called from inside the backward pass
    peers = [g for g in view if g.thread == "training" and g.ranks != "1"]
    assert sum(g.n_ranks for g in peers) == 3
    assert all(any(" in backward" in f for f in g.frames) for g in peers), peers
    assert "; stacks: rank 1 is at test_torch_gloo.py:" in hangs[-1].summary


@pytest.mark.timed
def test_a_long_checkpoint_is_work_not_a_hang(sock):
    """Rank 0 spends 14 s in `torch.save` (past the 10 s hang timeout) while its peers wait
    for it in the next collective: the hook shows the save in flight, and no hang opens."""
    with DaemonThread(sock, 0.2) as d:
        procs = launch_ranks(sock, 12, save_s=14.0)
        _run_to_end(procs, timeout=120)
    messages = [(t, v) for t, _k, v in list(d.publisher.messages)]
    saving = [op for t, v in messages if t == HEARTBEATS for hb in [decode_heartbeat(v)]
              if hb.rank == 0 for op in hb.inflight if op.name == "host:checkpoint"]
    assert saving, "the save was never in flight"
    res = diagnose_messages(messages)
    assert [(i.kind, i.culprit) for i in res.incidents.values() if i.kind == "hang"] == []
    saves = [m for m in _steps_by_rank(d.publisher)[0] if "host:checkpoint" in m.name]
    (save,) = saves
    assert save.dur_ns[list(save.name).index("host:checkpoint")] >= 14e9


@pytest.mark.timed
def test_healthy_run_has_no_compute_outlier(sock):
    with DaemonThread(sock, 0.2) as d:
        _run_to_end(launch_ranks(sock, 6))
    by_rank = _steps_by_rank(d.publisher)
    fwd = np.array([np.median(_phase(ms[2:], "fwd")) for _r, ms in sorted(by_rank.items())])
    assert fwd.max() < 3 * np.median(fwd) + 0.02, fwd


@pytest.mark.timed
def test_gc_and_a_marked_phase_arrive_as_named_host_stalls(sock):
    """Issue #14: a rank's GC pauses and a phase it marks are ops of their own, named, and
    its forward no longer counts the GC it sat in."""
    steps = 6
    with DaemonThread(sock, 0.2) as d:
        _run_to_end(launch_ranks(sock, steps, stall_rank=1))
    by_rank = _steps_by_rank(d.publisher)
    stalled = by_rank[1][1:]  # the first step holds the process group's warm-up
    assert all("host:gc" in m.name for m in stalled)
    assert all(m.dur_ns[[n == "host:gc" for n in m.name]].min() > 0 for m in stalled)
    evals = _phase(stalled, "host:eval")
    assert np.all(evals >= 0.05) and np.all(evals < 0.5), evals
    assert all("host:eval" not in m.name for r in (0, 2, 3) for m in by_rank[r])


CRASHING_RANK = """
import os, signal, sys
import torch
import torch.distributed as dist
from producers import torch_hook

hook = torch_hook.install()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
for _ in range(3):
    t = torch.ones(2)
    dist.all_reduce(t)
    hook.step()
import time
time.sleep(1.0)  # a rank that crashes has run a while: its steps reached the daemon

def forward():
    {crash}

forward()
"""


@pytest.mark.parametrize(("crash", "reason"), [
    ("1 / 0", "exception: ZeroDivisionError: division by zero"),
    ("os.kill(os.getpid(), signal.SIGSEGV)", "signal: Segmentation fault"),
])
def test_a_rank_that_dies_says_why_and_where(sock, crash: str, reason: str) -> None:
    """Issue #14: an unhandled exception reaches the daemon with the goodbye, a fatal
    signal through the faulthandler file the hello named; both in the last heartbeat."""
    env = dict(os.environ, FLARE_AGENT_SOCKET=str(sock), FLARE_JOB="gloo-test",
               FLARE_NODE="node-test", FLARE_AGENT_INTERVAL_S="0.2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = CRASHING_RANK.format(port=_free_port(), crash=crash)
    with DaemonThread(sock, 0.2) as d:
        p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, timeout=120,
                           capture_output=True, text=True)
        assert p.returncode != 0
        deadline = time.monotonic() + 10
        while not d.daemon.core.stats.vanished and time.monotonic() < deadline:
            time.sleep(0.05)
    last = [decode_heartbeat(v) for t, _k, v in d.publisher.messages if t == HEARTBEATS]
    exits = [hb for hb in last if hb.exited]
    assert len(exits) == 1, p.stderr[-2000:]
    assert exits[0].exit_reason == reason
    assert exits[0].exit_stack and exits[0].exit_stack[-1].endswith(" in forward"), exits[0]
    assert not [v for t, _k, v in d.publisher.messages if t == JOBS
                and decode_job(v).event == "end"]  # a crash is no clean end of the job
    assert not list(sock.parent.glob("flare-fault-*"))  # the daemon cleaned up
