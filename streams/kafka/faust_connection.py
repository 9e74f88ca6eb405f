"""The worker's faust app on the same `KafkaConnection` as every other Flare client.

confluent-kafka takes the connection as librdkafka properties (`KafkaConnection.librdkafka`);
faust (aiokafka underneath) wants a list of `kafka://` URLs plus a credentials object, so this
module translates the one connection into that shape instead of keeping a second set of
settings. The secrets are revealed here, into the credentials handed to the library, and
nowhere else: faust's `SASLCredentials` shows only the user name in its repr.
"""

from __future__ import annotations

import ssl

from faust.auth import SASLCredentials, SSLCredentials

from schemas.kafka import KafkaConnection


def faust_broker_urls(conn: KafkaConnection) -> list[str]:
    """`host1:9092,host2:9092` -> faust's list of kafka:// URLs."""
    return [h if "://" in h else f"kafka://{h}" for h in conn.hosts]


def tls_context(conn: KafkaConnection) -> ssl.SSLContext:
    """A client TLS context from the connection's CA bundle and optional client certificate
    (without a CA bundle, the system's trusted CAs verify the brokers, as librdkafka does)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=conn.ssl_ca_location)
    if conn.ssl_certificate_location is not None:
        password = (conn.ssl_key_password.get_secret_value()
                    if conn.ssl_key_password is not None else None)
        context.load_cert_chain(conn.ssl_certificate_location, conn.ssl_key_location, password)
    return context


def faust_credentials(conn: KafkaConnection) -> SASLCredentials | SSLCredentials | None:
    """faust's `broker_credentials` for the connection: None for PLAINTEXT."""
    context = tls_context(conn) if conn.uses_tls else None
    if conn.uses_sasl:
        password = conn.sasl_password.get_secret_value() if conn.sasl_password else None
        return SASLCredentials(username=conn.sasl_username, password=password,
                               mechanism=conn.sasl_mechanism or "PLAIN", ssl_context=context)
    if context is not None:
        return SSLCredentials(context)
    return None
