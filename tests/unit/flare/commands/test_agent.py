"""`flare agent`: its options are checked at the edge, and a dry run serves the socket and
prints the recorded-stream lines it would publish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import orjson

from producers.torch_hook.buffer import OpLog, RankMeta
from producers.torch_hook.client import AgentClient
from schemas import topics
from schemas.decode import decode_heartbeat


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


def test_a_wrong_topology_is_one_line_and_exit_2(tmp_path):
    from typer.testing import CliRunner

    from flare.cli import app

    bad = tmp_path / "topo.json"
    bad.write_text('{"gpu01": 7}')
    res = CliRunner().invoke(app, ["agent", "--dry-run", "--topology", str(bad)])
    assert res.exit_code == 2
    assert res.output.strip() == ('error: topology: JSON topology must be {"node": "switch"} '
                                  'or [{"node", "switch"}]')
    res = CliRunner().invoke(app, ["agent", "--dry-run", "--topology-map", "gpu01"],
                             env={"FLARE_TOPOLOGY": ""})
    assert res.exit_code == 2 and "'gpu01' is not node=switch" in res.output


def test_flare_agent_command_dry_run(sock_path, eventually):
    """`flare agent --dry-run` serves the socket and prints recorded-stream lines."""
    code = ("import typer; from flare.commands import agent; app = typer.Typer(); "
            "agent.register(app); app.command('noop')(lambda: None); app()")
    env = dict(os.environ, FLARE_AGENT_SOCKET=str(sock_path), FLARE_NODE="node-cli",
               FLARE_AGENT_INTERVAL_S="0.05")
    proc = subprocess.Popen([sys.executable, "-c", code, "agent", "--dry-run"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        eventually(sock_path.exists, 30)
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
    topics_seen = {m["topic"] for m in lines}
    assert {topics.JOBS, topics.HEARTBEATS} <= topics_seen
    hb = next(m for m in lines if m["topic"] == topics.HEARTBEATS)
    assert hb["key"] == "job-cli" and hb["value"]["node"] == "node-cli"
    decode_heartbeat(orjson.dumps(hb["value"]))
