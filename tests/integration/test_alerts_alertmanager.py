"""A worker pushes its incidents to a real Alertmanager (Debian's `prometheus-alertmanager`,
on loopback): the alert appears with the incident's labels and link, then resolves."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flare.local.broker import TansuBroker, free_port
from tests.integration.conftest import WorkerProcess, unique, wait_for
from tests.integration.test_pipeline import offline, replay, simulate

AM_BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(AM_BINARY is None, reason="Debian's prometheus-alertmanager is not "
                       "installed"),
]


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    """An Alertmanager on loopback (no cluster peers, alerts routed nowhere); its URL."""
    port = free_port()
    config = tmp_path / "alertmanager.yml"
    config.write_text("route: {receiver: nowhere, group_wait: 1s}\n"
                      "receivers: [{name: nowhere}]\n")
    proc = subprocess.Popen(
        [str(AM_BINARY), f"--config.file={config}", f"--storage.path={tmp_path / 'am'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "alertmanager.log").open("wb"))
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 30, "Alertmanager to start")
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


def active_alerts(am: str, job: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{am}/api/v2/alerts", params={"filter": f'job="{job}"'}, timeout=5)
    r.raise_for_status()
    return [a for a in r.json() if a["status"]["state"] in ("active", "unprocessed")]


def test_an_incident_is_alerted_in_alertmanager_then_resolved(
        broker: TansuBroker, start_worker: Callable[..., WorkerProcess],
        alertmanager: str, tmp_path: Path) -> None:
    job = unique("am")
    rec = simulate(tmp_path / "rec.jsonl", job, gpus=16, steps=40, onset=12)
    (want,) = [i for i in offline([rec]).values() if i.kind == "gpu"]
    worker = start_worker(unique("g-am"), FLARE_ALERTMANAGER_URL=alertmanager,
                          FLARE_ALERT_RESEND_S="1")
    replay(rec, broker.bootstrap)

    seen: list[dict[str, Any]] = []

    def alerted() -> bool:
        seen[:] = active_alerts(alertmanager, job)
        return bool(seen)

    wait_for(alerted, 90, "the incident's alert in Alertmanager")
    (alert,) = seen
    labels = alert["labels"]
    assert (labels["alertname"], labels["kind"], labels["culprit"]) == (
        "FlareIncident", "gpu", want.culprit)
    assert labels["severity"] in ("critical", "warning")
    assert "slower" in alert["annotations"]["cost"]
    link = alert["annotations"]["url"]
    assert link.startswith(worker.api) and link.endswith(f"/v1/incidents/{want.id}")
    assert httpx.get(link, timeout=10).json()["culprit"] == want.culprit

    # the job ended: its incident resolves, and Alertmanager ends the alert
    wait_for(lambda: active_alerts(alertmanager, job) == [], 120,
             "the alert to resolve when the incident did")
