"""The agent process: the hook's client to the server over a real Unix socket, and the
`flare agent` command around it (a dry run prints what it would publish)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from producers.agent.core import AgentCore
from producers.agent.outbox import Outbox
from producers.agent.server import AgentDaemon
from producers.testing import MemoryPublisher
from producers.torch_hook.buffer import COLL, OpLog, RankMeta
from producers.torch_hook.client import AgentClient
from schemas import topics
from schemas.decode import decode_heartbeat, decode_job, decode_steps


@pytest.fixture
def sock_path():
    d = Path(tempfile.mkdtemp(prefix="flare-", dir="/tmp"))  # short: Unix socket paths are
    yield d / "a.sock"                                        # limited to ~100 bytes
    shutil.rmtree(d, ignore_errors=True)


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_hook_client_to_daemon_over_the_socket(sock_path):
    pub = MemoryPublisher()
    daemon = AgentDaemon(AgentCore("node-x"), Outbox(pub, flush_every_s=0.05), sock_path,
                         interval_s=0.05)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=lambda: loop.run_until_complete(daemon.serve(stop)))
    thread.start()
    try:
        _wait_for(sock_path.exists)
        log = OpLog()
        meta = RankMeta("job-s", 0, "node-x", 0, 2, {"dp": 0})
        client = AgentClient(sock_path, lambda: meta, log.inflight, interval_s=0.05)
        client.start()
        row = log.begin(COLL, "all_reduce", "dp.0", 0, 64)
        log.end(row)
        client.submit(log.cut())
        stuck = log.begin(COLL, "all_reduce", "dp.0", 1, 64)
        _wait_for(lambda: any(hb["inflight"] for hb in pub.on(topics.HEARTBEATS)))
        client.close(5)
        _wait_for(lambda: not daemon.core.ranks)  # the goodbye was read
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
    steps = [decode_steps(v) for t, _k, v in pub.messages if t == topics.STEPS]
    assert [(s.job, s.rank, s.step, s.name, s.coords) for s in steps] == [
        ("job-s", 0, 0, ["all_reduce"], {"dp": 0})]
    beats = [decode_heartbeat(v) for t, _k, v in pub.messages if t == topics.HEARTBEATS]
    inflight = [hb for hb in beats if hb.inflight]
    assert inflight[0].step == 1 and inflight[0].inflight[0].start_ns == stuck[4]
    assert [decode_job(v).event for t, _k, v in pub.messages if t == topics.JOBS] == [
        "start", "end"]
    assert client.stats.dropped_steps == 0 and not sock_path.exists()
