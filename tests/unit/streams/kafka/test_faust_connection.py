"""The one KafkaConnection in faust's shape: broker URLs and credentials."""

from __future__ import annotations

import ssl

from faust.auth import SASLCredentials, SSLCredentials
from faust.types.auth import AuthProtocol

from schemas.kafka import KafkaConnection
from streams.kafka.faust_connection import faust_broker_urls, faust_credentials


def test_broker_addresses_become_kafka_urls() -> None:
    conn = KafkaConnection(bootstrap="a:9092, b:9093")
    assert faust_broker_urls(conn) == ["kafka://a:9092", "kafka://b:9093"]
    assert faust_broker_urls(KafkaConnection(bootstrap="kafka://c:1")) == ["kafka://c:1"]


def test_plaintext_needs_no_credentials() -> None:
    assert faust_credentials(KafkaConnection(bootstrap="a:1")) is None


def test_tls_alone_is_an_ssl_context() -> None:
    creds = faust_credentials(KafkaConnection(bootstrap="a:1", security_protocol="SSL"))
    assert isinstance(creds, SSLCredentials) and creds.protocol == AuthProtocol.SSL
    assert creds.context.verify_mode == ssl.CERT_REQUIRED


def test_sasl_without_tls_keeps_the_mechanism_and_sends_no_context() -> None:
    conn = KafkaConnection(bootstrap="a:1", security_protocol="SASL_PLAINTEXT",
                           sasl_mechanism="SCRAM-SHA-256", sasl_username="u",
                           sasl_password="pw")
    creds = faust_credentials(conn)
    assert isinstance(creds, SASLCredentials)
    assert creds.protocol == AuthProtocol.SASL_PLAINTEXT and creds.ssl_context is None
    assert (creds.mechanism.value, creds.username, creds.password) == ("SCRAM-SHA-256", "u",
                                                                       "pw")
