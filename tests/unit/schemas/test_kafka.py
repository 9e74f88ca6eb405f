"""KafkaConnection: the one connection every client is built from; secrets never leak."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas.kafka import KafkaConnection


def test_plaintext_gives_only_servers_and_protocol() -> None:
    conn = KafkaConnection(bootstrap=" k1:9092 , k2:9092 ,")
    assert conn.hosts == ["k1:9092", "k2:9092"]
    assert conn.librdkafka() == {"bootstrap.servers": "k1:9092,k2:9092",
                                 "security.protocol": "PLAINTEXT"}
    assert not conn.uses_sasl and not conn.uses_tls


def test_sasl_ssl_reveals_secrets_only_in_the_client_config() -> None:
    conn = KafkaConnection(
        bootstrap="k:9093", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256",
        sasl_username="flare", sasl_password="pw-1", ssl_ca_location="/etc/ca.pem",
        ssl_key_password="pw-2",
    )
    shown = repr(conn) + str(conn) + conn.model_dump_json()
    assert "pw-1" not in shown and "pw-2" not in shown
    conf = conn.librdkafka()
    assert conf["sasl.mechanism"] == "SCRAM-SHA-256"
    assert conf["sasl.username"] == "flare"
    assert conf["sasl.password"] == "pw-1"
    assert conf["ssl.ca.location"] == "/etc/ca.pem"
    assert conf["ssl.key.password"] == "pw-2"
    assert "ssl.certificate.location" not in conf


def test_sasl_without_a_mechanism_defaults_to_plain_and_tls_fields_stay_out() -> None:
    conn = KafkaConnection(bootstrap="k:9092", security_protocol="SASL_PLAINTEXT",
                           sasl_username="u", sasl_password="p", ssl_ca_location="/ca.pem")
    conf = conn.librdkafka()
    assert conf["sasl.mechanism"] == "PLAIN"
    assert "ssl.ca.location" not in conf  # no TLS on SASL_PLAINTEXT


@pytest.mark.parametrize("bad", [{"bootstrap": " , "}, {"bootstrap": "k:1", "x": 1},
                                 {"bootstrap": "k:1", "security_protocol": "TLS"}])
def test_bad_connections_are_refused_with_the_field(bad: dict) -> None:
    with pytest.raises(ValidationError):
        KafkaConnection(**bad)


def test_the_connection_is_frozen() -> None:
    conn = KafkaConnection(bootstrap="k:1")
    with pytest.raises(ValidationError):
        conn.bootstrap = "other:1"  # type: ignore[misc]
