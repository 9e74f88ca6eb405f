"""The node daemon: pure core on a fake clock, the bounded outbox, and the real socket path."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from pathlib import Path

import orjson
import pytest

from producers.agent.daemon import (
    HEARTBEATS_TOPIC,
    JOBS_TOPIC,
    STEPS_TOPIC,
    AgentCore,
    AgentDaemon,
    Cadence,
    MemoryPublisher,
    Outbox,
)
from producers.torch_hook.buffer import COLL, OpLog, RankMeta
from producers.torch_hook.client import AgentClient
from producers.torch_hook.wire import (
    BYE,
    HELLO,
    INFLIGHT,
    STEPS,
    FrameError,
    decode_header,
    encode_frame,
)
from schemas.decode import decode_heartbeat, decode_job, decode_steps


class FakeClock:
    def __init__(self, t: int = 1_700_000_000_000_000_000) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t

    def advance(self, s: float) -> None:
        self.t += int(s * 1e9)


def hello(rank: int, world: int = 4, job: str = "j1") -> bytes:
    return orjson.dumps({"job": job, "rank": rank, "local_rank": rank, "node": "",
                         "world_size": world, "pid": 1})


STEP_MSG = orjson.dumps({"v": 1, "job": "j1", "rank": 0, "node": "n1", "step": 0,
                         "t_start_ns": 1, "t_end_ns": 2,
                         "ops": {"kind": [], "name": [], "group": [], "seq": [],
                                 "start_ns": [], "dur_ns": [], "bytes": []}})


def test_hello_of_rank_zero_starts_the_job_once():
    clock = FakeClock()
    core = AgentCore("n1", clock)
    out = core.on_frame(1, HELLO, hello(0))
    assert [(t, k) for t, k, _v in out] == [(JOBS_TOPIC, b"j1")]
    job = decode_job(out[0][2])
    assert job.event == "start" and job.world_size == 4 and job.ts_ns == clock.t
    assert core.on_frame(2, HELLO, hello(1)) == []
    core.on_disconnect(1)
    assert core.on_frame(3, HELLO, hello(0)) == []  # a reconnect does not restart the job


def test_steps_are_forwarded_untouched_keyed_by_job():
    core = AgentCore("n1", FakeClock())
    core.on_frame(1, HELLO, hello(0))
    assert core.on_frame(1, STEPS, STEP_MSG) == [(STEPS_TOPIC, b"j1", STEP_MSG)]


def test_heartbeats_report_inflight_since_when_and_stop_on_disconnect():
    clock = FakeClock()
    core = AgentCore("n1", clock)
    core.on_frame(1, HELLO, hello(0))
    core.on_frame(2, HELLO, hello(1))
    started = clock.t
    core.on_frame(1, INFLIGHT, orjson.dumps({"step": 7, "inflight": [
        {"group": "dp.0", "name": "all_reduce", "seq": 41, "start_ns": started}]}))
    core.on_frame(2, INFLIGHT, orjson.dumps({"step": 7, "inflight": []}))
    clock.advance(12)
    beats = {hb.rank: hb for hb in (decode_heartbeat(v) for _t, _k, v in core.heartbeats())}
    assert sorted(beats) == [0, 1]
    hb = beats[0]
    assert (hb.job, hb.node, hb.step, hb.ts_ns) == ("j1", "n1", 7, clock.t)
    assert [(o.group, o.name, o.seq, o.start_ns) for o in hb.inflight] == [
        ("dp.0", "all_reduce", 41, started)]
    assert beats[1].inflight == []
    core.on_disconnect(2)  # the rank's process died: silence, not a fake "idle"
    clock.advance(5)  # the keepalive of rank 0 (nothing else changed)
    assert [decode_heartbeat(v).rank for _t, _k, v in core.heartbeats()] == [0]


def table(step: int, *ops: tuple[str, int, int]) -> bytes:
    """An in-flight table frame: ops as (group, seq, start_ns)."""
    return orjson.dumps({"step": step, "inflight": [
        {"group": g, "name": "all_reduce", "seq": q, "start_ns": t} for g, q, t in ops]})


def sample(core: AgentCore, clock: FakeClock) -> dict[int, list[tuple[str, int]]]:
    """Advance one interval, sample: {rank: [(group, seq) in flight]} of what was published."""
    clock.advance(core.cadence.interval_s)
    beats = [decode_heartbeat(v) for _t, _k, v in core.heartbeats()]
    assert all(hb.ts_ns == clock.t for hb in beats)
    return {hb.rank: [(o.group, o.seq) for o in hb.inflight] for hb in beats}


def test_cadence_first_sample_then_only_long_op_changes_and_keepalives():
    clock = FakeClock()
    core = AgentCore("n1", clock, cadence=Cadence(interval_s=1.0, keepalive_s=5.0, long_op_s=1.0))
    core.on_frame(1, HELLO, hello(0))
    core.on_frame(2, HELLO, hello(1))
    assert sample(core, clock) == {0: [], 1: []}  # (a) the first sample of every rank
    # short ops come and go on both ranks: nothing is published until the keepalive
    for seq in range(3):
        core.on_frame(1, INFLIGHT, table(1, ("dp.0", seq, clock.t + 500_000_000)))
        core.on_frame(2, INFLIGHT, table(1))
        assert sample(core, clock) == {}
    core.on_frame(1, INFLIGHT, table(1))
    assert sample(core, clock) == {}
    # (c) keepalive: 5 s after the last published heartbeat
    assert sample(core, clock) == {0: [], 1: []}
    # (b) rank 0 enters an op that stays in flight: published at the first sample where it
    # is >= 1 s old, with the FULL list (a younger op rides along)
    t0 = clock.t + 200_000_000
    core.on_frame(1, INFLIGHT, table(2, ("dp.0", 6, t0)))
    assert sample(core, clock) == {}  # 0.8 s old at this sample: still short
    core.on_frame(1, INFLIGHT, table(2, ("dp.0", 6, t0), ("tp.0", 9, clock.t)))
    assert sample(core, clock) == {0: [("dp.0", 6), ("tp.0", 9)]}  # 1.8 s: long
    assert sample(core, clock) == {}  # same long set: quiet
    # the op ends: its end is published at the next sample
    core.on_frame(1, INFLIGHT, table(3))
    assert sample(core, clock) == {0: []}
    assert sample(core, clock) == {1: []}  # rank 1's keepalive is independent of rank 0's
    assert core.stats.samples == 2 * 11 and core.stats.heartbeats == 7


def test_cadence_keepalive_never_leaves_a_waiting_rank_silent_past_the_hang_timeout():
    clock = FakeClock()
    core = AgentCore("n1", clock, cadence=Cadence(interval_s=0.5, keepalive_s=3.0, long_op_s=1.0))
    core.on_frame(1, HELLO, hello(0))
    t0 = clock.t
    core.on_frame(1, INFLIGHT, table(4, ("dp.0", 1, t0)))
    published = []
    for _ in range(60):  # 30 s blocked in one collective
        clock.advance(0.5)
        if core.heartbeats():
            published.append(clock.t)
    gaps = [(b - a) / 1e9 for a, b in zip(published, published[1:], strict=False)]
    # first sample, the op turning long at 1 s, then keepalives every 3 s
    assert published[0] - t0 == 500_000_000 and gaps[0] == 0.5
    assert set(gaps[1:]) == {3.0}
    assert len(published) == 2 + 29 // 3


def test_a_reconnected_rank_is_published_at_its_first_sample():
    clock = FakeClock()
    core = AgentCore("n1", clock)
    core.on_frame(1, HELLO, hello(3))
    assert sample(core, clock) == {3: []}
    assert sample(core, clock) == {}
    core.on_disconnect(1)
    core.on_frame(2, HELLO, hello(3))
    assert sample(core, clock) == {3: []}


@pytest.mark.parametrize("kw, match", [
    ({"keepalive_s": 9.5}, "below the 10 s hang timeout"),
    ({"keepalive_s": 4.0, "long_op_s": 6.0}, "below the 10 s hang timeout"),
    ({"interval_s": 2.0, "keepalive_s": 1.0}, "must be >= interval_s"),
    ({"interval_s": 0.0}, "interval_s must be > 0"),
    ({"long_op_s": float("nan")}, "finite number"),
])
def test_invalid_cadence_says_why(kw, match):
    with pytest.raises(ValueError, match=match):
        Cadence(**kw)


def test_agent_command_rejects_a_keepalive_past_the_hang_timeout():
    import typer
    from typer.testing import CliRunner

    from flare.commands import agent

    app = typer.Typer()
    agent.register(app)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["agent", "--dry-run", "--keepalive-s", "12"])
    text = " ".join(res.output.replace("│", " ").split())  # unwrap the error box
    assert res.exit_code == 2 and "must stay below the 10 s hang timeout" in text


def test_bye_of_rank_zero_ends_the_job():
    core = AgentCore("n1", FakeClock())
    core.on_frame(1, HELLO, hello(0))
    out = core.on_frame(1, BYE, b"{}")
    assert decode_job(out[0][2]).event == "end"
    assert core.heartbeats() == []


@pytest.mark.parametrize("frames, match", [
    ([(STEPS, STEP_MSG)], "first frame"),
    ([(HELLO, b"{not json")], "bad hello"),
    ([(HELLO, orjson.dumps({"job": "", "rank": 0}))], "needs a job"),
    ([(HELLO, hello(0)), (INFLIGHT, orjson.dumps({"step": "x"}))], "in-flight"),
])
def test_protocol_violations_are_frame_errors(frames, match):
    core = AgentCore("n1", FakeClock())
    with pytest.raises(FrameError, match=match):
        for ftype, payload in frames:
            core.on_frame(1, ftype, payload)


def test_frame_header_round_trip_and_limits():
    raw = encode_frame(STEPS, b"abc")
    assert decode_header(raw[:5]) == (3, STEPS) and raw[5:] == b"abc"
    with pytest.raises(FrameError):
        decode_header(b"\x00\x00\x00\x01\x09")
    with pytest.raises(FrameError):
        decode_header(b"\xff\xff\xff\xff\x02")


class BlockedPublisher(MemoryPublisher):
    """A publisher stuck (broker away) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def publish(self, topic, key, value):
        self.release.wait(10)
        super().publish(topic, key, value)


def test_outbox_is_bounded_and_counts_what_it_drops():
    pub = BlockedPublisher()
    box = Outbox(pub, max_messages=5, flush_every_s=0.05)
    box.start()
    box.put([("t", b"k", b"%d" % i) for i in range(20)])
    pub.release.set()
    box.close(10)
    # One message may already be inside the blocked publish; the queue held at most 5 more.
    assert 5 <= len(pub.messages) <= 6
    assert box.stats.dropped == 20 - len(pub.messages)
    assert box.stats.published == len(pub.messages) and pub.flushes >= 1


@pytest.fixture
def sock_path():
    d = Path(tempfile.mkdtemp(prefix="flare-", dir="/tmp"))
    yield d / "a.sock"
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
        _wait_for(lambda: any(hb["inflight"] for hb in pub.on(HEARTBEATS_TOPIC)))
        client.close(5)
        _wait_for(lambda: not daemon.core.ranks)  # the goodbye was read
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
    steps = [decode_steps(v) for t, _k, v in pub.messages if t == STEPS_TOPIC]
    assert [(s.job, s.rank, s.step, s.name, s.coords) for s in steps] == [
        ("job-s", 0, 0, ["all_reduce"], {"dp": 0})]
    beats = [decode_heartbeat(v) for t, _k, v in pub.messages if t == HEARTBEATS_TOPIC]
    inflight = [hb for hb in beats if hb.inflight]
    assert inflight[0].step == 1 and inflight[0].inflight[0].start_ns == stuck[4]
    assert [decode_job(v).event for t, _k, v in pub.messages if t == JOBS_TOPIC] == [
        "start", "end"]
    assert client.stats.dropped_steps == 0 and not sock_path.exists()


def test_flare_agent_command_dry_run(sock_path):
    """`flare agent --dry-run` serves the socket and prints recorded-stream lines."""
    import os
    import signal
    import subprocess
    import sys

    code = ("import typer; from flare.commands import agent; app = typer.Typer(); "
            "agent.register(app); app.command('noop')(lambda: None); app()")
    env = dict(os.environ, FLARE_AGENT_SOCKET=str(sock_path), FLARE_NODE="node-cli",
               FLARE_AGENT_INTERVAL_S="0.05")
    proc = subprocess.Popen([sys.executable, "-c", code, "agent", "--dry-run"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(sock_path.exists, 30)
        meta = RankMeta("job-cli", 0, "", 0, 1)
        client = AgentClient(sock_path, lambda: meta, OpLog().inflight, interval_s=0.05)
        client.start()
        time.sleep(0.3)  # a few heartbeat periods of the daemon
        client.close(5)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = [orjson.loads(line) for line in out.splitlines()]
    topics = {m["topic"] for m in lines}
    assert {JOBS_TOPIC, HEARTBEATS_TOPIC} <= topics
    hb = next(m for m in lines if m["topic"] == HEARTBEATS_TOPIC)
    assert hb["key"] == "job-cli" and hb["value"]["node"] == "node-cli"
    decode_heartbeat(orjson.dumps(hb["value"]))
