"""The hook's sender: the first step of a rank reaches the agent even when the rank learns
who it is only after the hook started (the usual order: install, then init_process_group)."""

from __future__ import annotations

import time
from pathlib import Path

from producers.torch_hook.buffer import COLL, OpLog, RankMeta
from producers.torch_hook.client import AgentClient
from schemas import topics
from schemas.decode import decode_steps


def test_the_first_step_is_sent_when_identity_comes_after_the_hook_started(
        agent, sock_path, eventually):
    identity: list[RankMeta] = []
    log = OpLog()
    # a long reconnect pause: a connection attempt spent before the rank had an identity
    # would keep the first step from being sent for the whole pause
    client = AgentClient(sock_path, lambda: identity[0] if identity else None, log.inflight,
                         interval_s=0.02, retry_s=30.0)
    pub = agent.pub
    eventually(sock_path.exists)
    client.start()
    time.sleep(0.2)  # several in-flight tables are due while the rank is anonymous
    identity.append(RankMeta("job-f", 3, "node-x", 3, 4))
    row = log.begin(COLL, "all_reduce", "dp.0", 0, 64)
    log.end(row)
    client.submit(log.cut())
    eventually(lambda: pub.on(topics.STEPS))
    client.close(5)
    steps = [decode_steps(v) for t, _k, v in pub.messages if t == topics.STEPS]
    assert [(s.rank, s.step) for s in steps] == [(3, 0)]
    assert client.stats.dropped_steps == 0


def test_a_step_cut_before_the_identity_is_known_waits_in_the_queue():
    identity: list[RankMeta] = []
    client = AgentClient(Path("/nonexistent/flare.sock"),
                         lambda: identity[0] if identity else None, OpLog().inflight)
    client.submit(OpLog().cut())
    client._drain()  # the sender thread's work, run inline
    assert len(client._queue) == 1 and client.stats.dropped_steps == 0


def test_rank_zeros_hello_carries_the_jobs_node_list_and_no_other_rank_does():
    import orjson

    for rank, expected in ((0, "gpu-[01-04]"), (2, None)):
        client = AgentClient(Path("/nonexistent/flare.sock"),
                             lambda r=rank: RankMeta("j", r, "gpu-01", r, 4), OpLog().inflight)
        client.job_nodes = "gpu-[01-04]"
        hello = client._hello()
        assert hello is not None
        assert orjson.loads(hello).get("job_nodes") == expected


def test_a_step_waits_in_the_queue_while_no_daemon_listens():
    """The daemon's socket is not accepting yet (or it restarts): the step stays queued for
    the next attempt instead of being dropped (a rank's first step was lost that way when
    the hook connected between the daemon's bind and its listen)."""
    client = AgentClient(Path("/nonexistent/flare.sock"), lambda: RankMeta("j", 0, "n"),
                         OpLog().inflight)
    client.submit(OpLog().cut())
    client._drain()
    assert len(client._queue) == 1 and client.stats.dropped_steps == 0
