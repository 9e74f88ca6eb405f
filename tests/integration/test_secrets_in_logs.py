"""Secrets never reach a log: a real worker (banner on, logging at debug) and `flare up`, run
with every secret Flare takes set, write none of them, while the worker delivers alerts to
receivers whose URLs carry credentials (nothing listens there, so every failure is logged),
and its /v1 asks for the key while its probes, stats and metrics do not."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flare.local import processes
from flare.local.broker import TansuBroker, free_port, port_in_use
from flare.local.processes import WorkerProcess, flare_argv
from tests.integration.conftest import PARTITIONS, ROOT, unique, wait_for
from tests.integration.test_pipeline import replay, simulate

pytestmark = pytest.mark.integration
KEY = "api-Key-4sec"
CLOSED = free_port()  # nothing listens here: every delivery fails and is logged


def secret_env() -> dict[str, str]:
    """Every secret a Flare process takes, each one distinct and easy to spot."""
    return {
        "FLARE_API_KEY": KEY,
        "FLARE_CLICKHOUSE_PASSWORD": "ch-Pw-1sec",  # chDB has no password: read, unused
        "FLARE_KAFKA_SASL_USERNAME": "flare",
        "FLARE_KAFKA_SASL_PASSWORD": "sasl-Pw-2sec",  # PLAINTEXT: read, unused
        "FLARE_KAFKA_SSL_KEY_PASSWORD": "tls-Pw-3sec",
        "FLARE_ALERTMANAGER_URL": f"http://oncall:am-Pw-5sec@127.0.0.1:{CLOSED}",
        "FLARE_WEBHOOK_URL": f"http://127.0.0.1:{CLOSED}/services/T0/hook-Tok-6sec",
        "FLARE_ALERT_RESEND_S": "1",
    }


SECRETS = ("api-Key-4sec", "ch-Pw-1sec", "sasl-Pw-2sec", "tls-Pw-3sec", "am-Pw-5sec",
           "hook-Tok-6sec")


def assert_no_secret(text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{leaked} leaked:\n" + "\n".join(
        line for line in text.splitlines() if any(s in line for s in leaked))


@pytest.fixture
def worker(broker: TansuBroker, tmp_path: Path) -> Iterator[WorkerProcess]:
    """`flare worker` with its banner (no --quiet), at debug level, with every secret set."""
    port = free_port()
    env = {
        **processes.with_kafka(os.environ, broker.connection),
        "FLARE_CLICKHOUSE_URL": processes.chdb_url(tmp_path / "chdb"),
        "FLARE_GROUP_ID": unique("g-secrets"), "FLARE_PARTITIONS": str(PARTITIONS),
        "FLARE_API_HOST": "127.0.0.1", "FLARE_API_PORT": str(port), "FLARE_LOG_LEVEL": "debug",
        **secret_env(),
    }
    child = processes.spawn("worker", flare_argv("worker"), tmp_path / "worker.log", env,
                            cwd=ROOT)
    w = WorkerProcess(child, f"http://127.0.0.1:{port}", tmp_path / "chdb")
    try:
        w.wait_ready(120)
        yield w
    finally:
        w.stop()


def test_a_worker_guards_v1_and_logs_no_secret_while_alerts_fail(
        worker: WorkerProcess, broker: TansuBroker, tmp_path: Path) -> None:
    job = unique("secrets")
    replay(simulate(tmp_path / "rec.jsonl", job, gpus=16, steps=40, onset=12), broker.bootstrap)

    def stored() -> bool:
        r = httpx.get(f"{worker.api}/v1/incidents", params={"job": job},
                      headers={"X-API-Key": KEY}, timeout=10)
        return r.status_code == 200 and bool(r.json()["items"])

    wait_for(stored, 120, "the incident, read with the key")
    refused = httpx.get(f"{worker.api}/v1/incidents", params={"job": job}, timeout=10)
    assert refused.status_code == 401 and refused.headers["www-authenticate"]
    for path in ("/readyz", "/healthz", "/metrics", "/worker/stats"):
        assert worker.get(path).status_code == 200, path
    wait_for(lambda: "could not deliver an alert" in worker.log(), 60,
             "a failed delivery in the log")
    worker.stop()
    log = worker.log()
    assert "flare worker: Kafka " in log  # the banner is in this log
    assert f"http://127.0.0.1:{CLOSED}/…" in log  # the receiver, named without its token
    assert_no_secret(log)


def test_flare_up_prints_and_logs_no_secret(tmp_path: Path) -> None:
    """Its own empty tansu: on the shared broker its worker would find the other tests'
    incidents, and `flare up` would follow them instead of timing out."""
    api_port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FLARE_")},
           "FLARE_KAFKA_PORT": str(free_port()), "FLARE_API_PORT": str(api_port),
           "FLARE_LOG_LEVEL": "info", **secret_env()}
    result = subprocess.run(
        flare_argv("up", "--timeout", "1", "--data-dir", str(tmp_path / "data")),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 3, result.stdout + result.stderr  # no incident: timed out
    assert f"API at http://127.0.0.1:{api_port}" in result.stdout
    worker_log = (tmp_path / "data/logs/worker.log").read_text()
    assert worker_log  # the worker ran and wrote its log
    assert_no_secret(result.stdout + result.stderr + worker_log)
    assert not port_in_use("127.0.0.1", api_port)
