"""The agent process: the hook's client to the server over a real Unix socket, and the
`flare agent` command around it (a dry run prints what it would publish)."""

from __future__ import annotations

from producers.torch_hook.buffer import COLL, OpLog, RankMeta
from producers.torch_hook.client import AgentClient
from schemas import topics
from schemas.decode import decode_heartbeat, decode_job, decode_steps


def test_hook_client_to_daemon_over_the_socket(agent, sock_path, eventually):
    pub, daemon = agent.pub, agent.daemon
    try:
        eventually(sock_path.exists)
        log = OpLog()
        meta = RankMeta("job-s", 0, "node-x", 0, 2, {"dp": 0})
        client = AgentClient(sock_path, lambda: meta, log.inflight, interval_s=0.05)
        client.start()
        row = log.begin(COLL, "all_reduce", "dp.0", 0, 64)
        log.end(row)
        client.submit(log.cut())
        stuck = log.begin(COLL, "all_reduce", "dp.0", 1, 64)
        eventually(lambda: any(hb["inflight"] for hb in pub.on(topics.HEARTBEATS)))
        client.close(5)
        eventually(lambda: not daemon.core.ranks)  # the goodbye was read
    finally:
        agent.stop()
    steps = [decode_steps(v) for t, _k, v in pub.messages if t == topics.STEPS]
    assert [(s.job, s.rank, s.step, s.name, s.coords) for s in steps] == [
        ("job-s", 0, 0, ["all_reduce"], {"dp": 0})]
    beats = [decode_heartbeat(v) for t, _k, v in pub.messages if t == topics.HEARTBEATS]
    inflight = [hb for hb in beats if hb.inflight]
    assert inflight[0].step == 1 and inflight[0].inflight[0].start_ns == stuck[4]
    assert [decode_job(v).event for t, _k, v in pub.messages if t == topics.JOBS] == [
        "start", "end"]
    assert client.stats.dropped_steps == 0 and not sock_path.exists()
