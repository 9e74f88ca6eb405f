"""`flare up --simulate --exit-after-incident`: the one-command local stack, end to end.

It starts its own tansu (on a free port), a worker with the API and a simulated cluster,
prints the first incident and stops everything it started.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from flare.local.broker import free_port, port_in_use
from flare.local.processes import flare_argv
from tests.integration.conftest import ROOT

pytestmark = pytest.mark.integration


def test_flare_up_simulates_prints_the_first_incident_and_cleans_up(tmp_path: Path) -> None:
    kafka_port, api_port = free_port(), free_port()
    env = {**os.environ, "FLARE_KAFKA_PORT": str(kafka_port), "FLARE_API_PORT": str(api_port)}
    for var in ("FLARE_KAFKA_BOOTSTRAP", "FLARE_CLICKHOUSE_URL"):
        env.pop(var, None)
    result = subprocess.run(
        flare_argv("up", "--simulate", "--gpus", "64", "--exit-after-incident", "--timeout",
                   "120", "--data-dir", str(tmp_path / "data")),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert f"started tansu at 127.0.0.1:{kafka_port}" in out
    assert f"API at http://127.0.0.1:{api_port}" in out
    incident = [line for line in out.splitlines() if "INCIDENT" in line]
    assert len(incident) == 1
    assert "[gpu]" in incident[0] and "rank:" in incident[0] and "slower" in incident[0]
    assert not port_in_use("127.0.0.1", kafka_port), "tansu was left running"
    assert not port_in_use("127.0.0.1", api_port), "the worker was left running"
    assert (tmp_path / "data" / "chdb").is_dir()
