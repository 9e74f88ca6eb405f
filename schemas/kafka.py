"""How to reach the bus: one connection object for every Kafka client Flare runs.

The CLI builds it once from `FLARE_KAFKA_*` settings and passes it down to the publisher (node
agent, replay, simulator), the worker's faust app, the topic admin, the followers and the
benchmarks. Secrets are `SecretStr`, so they never show in a repr or a log line; they are
revealed only in the client configuration handed to the library.

>>> conn = KafkaConnection(bootstrap="kafka-1:9092,kafka-2:9092")
>>> conn.librdkafka()["bootstrap.servers"]
'kafka-1:9092,kafka-2:9092'
>>> secure = KafkaConnection(bootstrap="k:9093", security_protocol="SASL_SSL",
...                          sasl_mechanism="SCRAM-SHA-512", sasl_username="flare",
...                          sasl_password="s3cret")
>>> "s3cret" in repr(secure)
False
>>> secure.librdkafka()["sasl.password"]
's3cret'
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


class KafkaConnection(BaseModel):
    """Bootstrap servers plus the optional SASL and TLS material of one Kafka cluster."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap: str = Field(description="comma-separated host:port list")
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_ca_location: str | None = Field(None, description="CA bundle (PEM) to verify brokers")
    ssl_certificate_location: str | None = Field(None, description="client certificate (PEM)")
    ssl_key_location: str | None = Field(None, description="client private key (PEM)")
    ssl_key_password: SecretStr | None = None

    @field_validator("bootstrap")
    @classmethod
    def _hosts_given(cls, value: str) -> str:
        hosts = [h.strip() for h in value.split(",") if h.strip()]
        if not hosts:
            raise ValueError("empty Kafka bootstrap address")
        return ",".join(hosts)

    @property
    def hosts(self) -> list[str]:
        """The bootstrap servers as a list of host:port."""
        return self.bootstrap.split(",")

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol.startswith("SASL")

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol.endswith("SSL")

    def librdkafka(self) -> dict[str, str]:
        """Connection part of a confluent-kafka (librdkafka) client configuration."""
        conf = {"bootstrap.servers": self.bootstrap, "security.protocol": self.security_protocol}
        if self.uses_sasl:
            conf["sasl.mechanism"] = self.sasl_mechanism or "PLAIN"
            if self.sasl_username is not None:
                conf["sasl.username"] = self.sasl_username
            if self.sasl_password is not None:
                conf["sasl.password"] = self.sasl_password.get_secret_value()
        if self.uses_tls:
            optional = {
                "ssl.ca.location": self.ssl_ca_location,
                "ssl.certificate.location": self.ssl_certificate_location,
                "ssl.key.location": self.ssl_key_location,
                "ssl.key.password": (
                    self.ssl_key_password.get_secret_value() if self.ssl_key_password else None
                ),
            }
            conf.update({k: v for k, v in optional.items() if v is not None})
        return conf
