"""Child processes of the local stack: the connection they inherit, how they stop."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from flare.local.processes import spawn, with_kafka
from flare.settings import Settings
from schemas.kafka import KafkaConnection


def test_a_child_rebuilds_the_parents_kafka_connection_from_its_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    conn = KafkaConnection(bootstrap="k1:9093,k2:9093", security_protocol="SASL_SSL",
                           sasl_mechanism="SCRAM-SHA-256", sasl_username="flare",
                           sasl_password="pw", ssl_ca_location="/etc/ca.pem")
    parent = {"FLARE_KAFKA_SSL_KEY_LOCATION": "/stale/key.pem", "PATH": "/bin"}
    env = with_kafka(parent, conn)
    assert env["PATH"] == "/bin" and "FLARE_KAFKA_SSL_KEY_LOCATION" not in env
    for name in list(os.environ):
        if name.startswith("FLARE_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings().kafka_connection() == conn


def test_a_child_is_stopped_with_sigterm_and_its_log_kept(tmp_path: Path) -> None:
    code = "import sys, time; print('up', flush=True); time.sleep(60)"
    child = spawn("sleeper", [sys.executable, "-c", code], tmp_path / "logs" / "s.log",
                  os.environ)
    while "up" not in child.log():  # a real process: poll its log until it started
        assert child.alive()
        time.sleep(0.01)
    assert child.stop(timeout_s=10.0) == -signal.SIGTERM
    assert not child.alive() and child.log_tail() == "up"
    assert child.stop() == -signal.SIGTERM  # idempotent
