"""A real Prometheus (Debian's `prometheus`, on loopback) scrapes a running worker's /metrics
while it diagnoses a recorded job with a slow GPU: what it stores is what the worker did."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from flare.local.broker import TansuBroker, free_port
from schemas.topics import STEPS
from tests.integration.conftest import WorkerProcess, unique, wait_for
from tests.integration.test_pipeline import offline, replay, simulate
from tests.unit.streams.test_metrics import promtool_check

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("prometheus") is None,
                       reason="prometheus (Debian's prometheus package) is not installed"),
]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """Start a Prometheus on loopback scraping `target` (host:port) every second; returns
    its base URL."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(target: str) -> str:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - {{job_name: flare-worker, static_configs: [{{targets: ['{target}']}}]}}\n")
        procs.append(subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb")))
        return f"http://127.0.0.1:{port}"

    yield start
    for p in procs:
        p.terminate()
        p.wait(20)


def query(base: str, promql: str) -> dict[str, float]:
    """Instant query: {series labels as text: value}; {} while Prometheus is not up."""
    try:
        r = httpx.get(f"{base}/api/v1/query", params={"query": promql}, timeout=5)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    return {str(s["metric"]): float(s["value"][1]) for s in r.json()["data"]["result"]}


def test_prometheus_scrapes_what_the_worker_consumed_found_and_costs(
        broker: TansuBroker, start_worker: Callable[..., WorkerProcess],
        prometheus: Callable[[str], str], tmp_path: Path) -> None:
    job = unique("prom")
    rec = simulate(tmp_path / "rec.jsonl", job, gpus=16, steps=40, onset=12)
    worker = start_worker(unique("g-prom"))
    base = prometheus(worker.api.removeprefix("http://"))
    replay(rec, broker.bootstrap)
    steps = sum(1 for line in rec.read_bytes().splitlines() if STEPS.encode() in line[:40])
    want = offline([rec])
    assert any(i.kind == "gpu" for i in want.values())

    def scraped() -> bool:
        got = query(base, f'flare_worker_messages_total{{topic="{STEPS}"}}')
        lost = query(base, 'flare_lost_gpu_seconds_total{kind="gpu"}')
        return bool(got) and max(got.values()) >= steps and bool(lost) and max(
            lost.values()) > 0

    wait_for(scraped, 90, "Prometheus to scrape the worker's counters")
    assert max(query(base, 'up{job="flare-worker"}').values()) == 1
    assert query(base, "flare_worker_step_diagnosis_seconds_count")
    assert max(query(base, "flare_worker_consumer_lag_messages").values()) == 0
    assert max(query(base, 'flare_build_info').values()) == 1
    page = httpx.get(f"{worker.api}/metrics", timeout=10)
    assert page.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "flare_api_requests_total" in page.text  # the API's, on the same page
    promtool_check(page.text)
