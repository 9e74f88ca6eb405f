"""The agent's per-rank Prometheus metrics: what the step messages said, served on /metrics."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest

from producers.agent.core import AgentCore
from producers.agent.metrics import NodeMetrics
from producers.agent.outbox import Outbox
from producers.agent.server import AgentDaemon
from producers.testing import MemoryPublisher
from producers.torch_hook.buffer import COLL, COMPUTE, OpLog, RankMeta
from producers.torch_hook.client import AgentClient

S = 1_000_000_000


def _step(rank: int, step: int, ops: list[tuple[str, str, str, int, int, int]],
          span_s: float = 1.0, job: str = "j") -> bytes:
    """ops: (kind, name, group, start_ns, dur_ns, bytes)."""
    cols = list(zip(*ops, strict=True)) if ops else [[]] * 6
    return orjson.dumps({
        "v": 1, "job": job, "rank": rank, "node": "n0", "step": step, "t_start_ns": 0,
        "t_end_ns": int(span_s * S), "ops": {
            "kind": list(cols[0]), "name": list(cols[1]), "group": list(cols[2]),
            "seq": list(range(len(ops))), "start_ns": list(cols[3]), "dur_ns": list(cols[4]),
            "bytes": list(cols[5])}})


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_shares_latency_bandwidth_gc_and_steps_per_rank() -> None:
    m = NodeMetrics("n0")
    for step in range(3):
        m.observe_step(_step(1, step, [
            ("compute", "fwd", "", 0, 400_000_000, 0),
            ("compute", "host:gc", "", 400_000_000, 100_000_000, 0),
            # two async collectives overlapping: communication is their union, 0.3 s
            ("coll", "all_reduce", "dp.0", 500_000_000, 300_000_000, 150_000_000),
            ("coll", "all_gather", "tp.0", 600_000_000, 100_000_000, 10_000_000),
            ("p2p", "send", "pp.1-5", 900_000_000, 50_000_000, 1_000_000),
        ]))
    got = _samples(m.render(now_ns=10 * S))
    who = 'job="j",node="n0",rank="1"'
    assert got[f"flare_rank_step_seconds{{{who}}}"] == 1.0
    share = 'flare_rank_step_time_ratio{{job="j",node="n0",part="{}",rank="1"}}'
    assert got[share.format("compute")] == 0.4
    assert got[share.format("communication")] == pytest.approx(0.35)
    assert got[share.format("idle")] == pytest.approx(0.25)  # GC is idle time, not compute
    dp = f'group_kind="dp",{who}'
    assert got[f"flare_rank_bus_bandwidth_bytes_per_second{{{dp}}}"] == pytest.approx(1e9)
    p99 = 'flare_rank_collective_latency_seconds{group_kind="dp",job="j",node="n0",' \
          'quantile="0.99",rank="1"}'
    assert got[p99] == pytest.approx(0.3)
    assert got[f"flare_rank_collective_latency_seconds_count{{{dp}}}"] == 3
    assert got[f"flare_rank_gc_seconds_total{{{who}}}"] == pytest.approx(0.3)
    assert got[f"flare_rank_steps_total{{{who}}}"] == 3
    assert got[f"flare_rank_hang{{{who}}}"] == 0


def test_the_hang_flag_a_bad_message_and_a_finished_job() -> None:
    m = NodeMetrics("n0")
    m.observe_step(_step(0, 0, []))
    m.observe_step(b"{not json")
    text = m.render(now_ns=30 * S, inflight_since=lambda _j, _r: [5 * S])  # 25 s in flight
    assert _samples(text)['flare_rank_hang{job="j",node="n0",rank="0"}'] == 1
    assert _samples(text)['flare_agent_unreadable_steps_total{node="n0"}'] == 1
    m.forget("j")
    assert "rank=" not in m.render(now_ns=30 * S)


@pytest.fixture
def metrics_agent(sock_path: Path):
    """An agent daemon with its metrics endpoint on a free loopback port."""
    daemon = AgentDaemon(AgentCore("node-x"), Outbox(MemoryPublisher(), flush_every_s=0.05),
                         sock_path, interval_s=0.05, metrics_port=_free_port(),
                         metrics_host="127.0.0.1", version="9.9")
    loop, stop = asyncio.new_event_loop(), asyncio.Event()
    thread = threading.Thread(target=lambda: loop.run_until_complete(daemon.serve(stop)))
    thread.start()
    yield daemon
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_scrape_shows_the_ranks_the_hook_reported(metrics_agent, sock_path, eventually,
                                                    tmp_path: Path) -> None:
    eventually(lambda: metrics_agent.metrics_bound is not None and sock_path.exists())
    log = OpLog()
    client = AgentClient(sock_path, lambda: RankMeta("job-m", 2, "node-x", 0, 4, {}),
                         log.inflight, interval_s=0.05)
    client.start()
    for _ in range(2):
        log.end(log.begin(COMPUTE, "fwd", "", -1, 0))
        log.end(log.begin(COLL, "all_reduce", "dp.0", 0, 4096))
        client.submit(log.cut())
    port = metrics_agent.metrics_port
    eventually(lambda: 'flare_rank_steps_total{job="job-m",node="node-x",rank="2"} 2'
               in _get(port, "/metrics")[1])
    status, text = _get(port, "/metrics")
    assert status == 200 and 'flare_agent_build_info{node="node-x",version="9.9"} 1' in text
    assert _get(port, "/other")[0] == 404
    client.close(5)
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    checked = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                             capture_output=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
