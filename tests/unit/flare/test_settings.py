"""Settings: read from FLARE_* once at the edge, handed down as values."""

from __future__ import annotations

import pytest

from detectors.config import DetectorConfig
from flare.settings import DetectorSettings, Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    for name in list(os.environ):
        if name.startswith("FLARE_"):
            monkeypatch.delenv(name)


def test_the_kafka_connection_comes_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLARE_KAFKA_BOOTSTRAP", "kafka-a:9093,kafka-b:9093")
    monkeypatch.setenv("FLARE_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("FLARE_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("FLARE_KAFKA_SASL_USERNAME", "flare")
    monkeypatch.setenv("FLARE_KAFKA_SASL_PASSWORD", "hunter2")
    settings = Settings()
    assert "hunter2" not in repr(settings)
    conn = settings.kafka_connection()
    assert conn.hosts == ["kafka-a:9093", "kafka-b:9093"]
    assert conn.librdkafka()["sasl.password"] == "hunter2"
    assert "hunter2" not in repr(conn)


def test_no_bootstrap_means_the_local_broker_and_an_override_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLARE_KAFKA_PORT", "29092")
    assert Settings().kafka_connection().bootstrap == "127.0.0.1:29092"
    assert Settings().kafka_connection("127.0.0.1:5555").bootstrap == "127.0.0.1:5555"


def test_detector_settings_become_the_frozen_detector_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert DetectorSettings().config() == DetectorConfig()
    monkeypatch.setenv("FLARE_DETECT_RESOLVE_AFTER", "3")
    monkeypatch.setenv("FLARE_DETECT_HANG_TIMEOUT_S", "42")
    config = DetectorSettings().config()
    assert (config.resolve_after, config.hang_timeout_s) == (3, 42.0)
    assert config.window == DetectorConfig().window
