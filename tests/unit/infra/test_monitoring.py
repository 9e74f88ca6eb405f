"""The compose deployment's Prometheus and Alertmanager configs, checked by their own tools
(Debian's `prometheus` and `prometheus-alertmanager` packages): promtool validates the
scrape config and the rules and runs a rule test on synthetic series; amtool validates the
routing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROM = ROOT / "infra" / "prometheus"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} (Debian's prometheus packages) is not installed")
    return path


def _run(*argv: str, cwd: Path | None = None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_prometheus_config_and_rules_are_valid() -> None:
    promtool = _tool("promtool")
    assert "SUCCESS" in _run(promtool, "check", "config", str(PROM / "prometheus.yml"))
    assert "4 rules found" in _run(promtool, "check", "rules", str(PROM / "flare-rules.yml"))


def test_a_diagnosis_five_minutes_behind_pages_and_a_caught_up_one_does_not(
        tmp_path: Path) -> None:
    promtool = _tool("promtool")
    shutil.copy(PROM / "flare-rules.yml", tmp_path / "flare-rules.yml")
    (tmp_path / "test.yml").write_text("""
rule_files: [flare-rules.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'flare_worker_event_time_lag_seconds{instance="w1",topic="flare.steps.v1"}'
        values: '10x5 600x10'
      - series: 'flare_worker_event_time_lag_seconds{instance="w2",topic="flare.steps.v1"}'
        values: '5x15'
    alert_rule_test:
      - eval_time: 4m
        alertname: FlareDiagnosisBehind
        exp_alerts: []
      - eval_time: 12m
        alertname: FlareDiagnosisBehind
        exp_alerts:
          - exp_labels: {severity: warning, instance: w1}
            exp_annotations:
              summary: "Flare's diagnosis is 10m 0s behind the training"
""")
    _run(promtool, "test", "rules", "test.yml", cwd=tmp_path)


def test_alertmanager_config_is_valid() -> None:
    amtool = _tool("amtool")
    out = _run(amtool, "check-config", str(ROOT / "infra" / "alertmanager" / "alertmanager.yml"))
    assert "SUCCESS" in out
