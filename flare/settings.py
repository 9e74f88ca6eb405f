"""The one settings object, read from `FLARE_*` environment variables at the edges.

Built once by the CLI command or the app's lifespan and passed down; nothing reads the
environment deeper in the code.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from detectors.config import DetectorConfig
from schemas.kafka import KafkaConnection, SaslMechanism, SecurityProtocol
from schemas.redact import redact_url

# Settings that are URLs which may carry credentials, and whether their user and path may be
# secrets too (a webhook's path often is its token).
_URLS = {"clickhouse_url": False, "alertmanager_url": True, "webhook_url": True}


class DetectorSettings(BaseSettings):
    """Knobs of the detection core; defaults are the ones ACCURACY.md was measured with."""

    model_config = SettingsConfigDict(env_prefix="FLARE_DETECT_", extra="ignore")

    grace_s: float = Field(5.0, description="wait at least this long for missing ranks")
    grace_steps: float = Field(
        0.5, description="... and at least this many of the job's recent step times")
    window: int = Field(50, description="normal steps in the δ baseline")
    delta: float = Field(1.1, description="δ: a step this many times the normal is irregular")
    hang_timeout_s: float = Field(10.0, description="floor of the hang timeout ...")
    hang_timeout_steps: float = Field(
        3.0, description="... which is this many baseline step times")
    resolve_after: int = Field(
        10, description="steps with the culprit not even a suspect before an incident resolves"
    )
    ops_sample_every: int = Field(100, description="keep raw ops of every Nth step")
    price_ops: int = Field(
        2_000_000, ge=1, description="ops per step the what-if prices every evidence step of; "
        "a larger step every (its ops / this)-th, the steps between at its last estimate")

    def config(self) -> DetectorConfig:
        """The frozen value the detectors are built with."""
        return DetectorConfig(
            grace_s=self.grace_s, grace_steps=self.grace_steps, window=self.window,
            delta=self.delta, hang_timeout_s=self.hang_timeout_s,
            hang_timeout_steps=self.hang_timeout_steps, resolve_after=self.resolve_after,
            ops_sample_every=self.ops_sample_every, price_ops=self.price_ops,
        )


class Settings(BaseSettings):
    """Process settings: where the broker and ClickHouse are, and how to run."""

    model_config = SettingsConfigDict(env_prefix="FLARE_", extra="ignore")

    kafka_bootstrap: str = Field("", description="host:port of Kafka; empty: start tansu")
    kafka_port: int = Field(19092, description="port of the local tansu broker")
    kafka_security_protocol: SecurityProtocol = "PLAINTEXT"
    kafka_sasl_mechanism: SaslMechanism | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_ca_location: str | None = None
    kafka_ssl_certificate_location: str | None = None
    kafka_ssl_key_location: str | None = None
    kafka_ssl_key_password: SecretStr | None = None
    partitions: int = Field(4, description="partitions of each flare topic")
    broker_wait_s: float = Field(
        10.0, gt=0, description="how long a worker waits for the broker to answer at start "
        "before it gives up with one line (compose restarts it; a typo fails fast)"
    )
    clickhouse_url: str = Field("chdb:///./data/chdb", description="chdb:///path or http(s)://")
    clickhouse_password: SecretStr = Field(SecretStr(""), description="ClickHouse password")
    clickhouse_connect_timeout_s: int = Field(
        5, ge=1, description="seconds to open a connection to a ClickHouse server (a host that "
        "drops packets holds a write this long, twice: the client retries a connect once)"
    )
    clickhouse_read_timeout_s: int = Field(
        30, ge=1, description="seconds a call waits for a ClickHouse server's next bytes before "
        "it fails and the write is retried (a server that accepts and never answers); not a "
        "limit on a long statement, for which the server sends progress headers"
    )
    clickhouse_write_stall_s: float = Field(
        5.0, gt=0, description="/readyz fails while a worker's write has waited this long for "
        "ClickHouse (the write goes on; its batch stays un-acked until stored)"
    )
    worker_shutdown_write_s: float = Field(
        10.0, gt=0, description="a stopping worker waits at most this long for its last write "
        "to ClickHouse (and the one out), then exits with those records un-acked: the "
        "partitions' next owner reads them again. Keep it under the orchestrator's grace period"
    )
    api_host: str = "127.0.0.1"
    api_port: int = Field(8000, ge=1, le=65535)
    api_key: SecretStr | None = Field(
        None, description="a key every /v1 request must carry (X-API-Key or Authorization: "
        "Bearer); the CLI's API clients send it. Unset or empty: the API is open (api/auth.py)"
    )
    group_id: str = "flare-worker"
    max_message_bytes: int = 8 * 1024 * 1024
    log_level: str = "warn"
    kafka_session_timeout_s: float = Field(
        6.0, description="consumer-group session timeout; tansu joins in about half of it"
    )
    kafka_fetch_max_wait_ms: int = Field(
        20, ge=0, description="longest a worker's fetch waits on quiet partitions (faust's "
        "own is 1,500 ms, which idles a busy worker: see streams/kafka/faust_consumer.py)"
    )
    decoder_cache_ranks: int = Field(
        16_384, ge=0, description="ranks whose repeating op columns the worker's steps decoder "
        "keeps (~14 KB each); keep it >= the ranks one worker serves, or decoding slows ~2.5x"
    )
    worker_stall_s: float = Field(
        30.0, description="/readyz fails when input waits and nothing was processed this long"
    )
    job_idle_s: float = Field(
        600.0, description="a job silent this long is flushed and its state dropped"
    )
    alertmanager_url: str = Field(
        "", description="Alertmanager base URL (http://host:9093): incidents are pushed to its "
        "v2 API, re-sent while open, ended on resolve; empty: no alerts"
    )
    webhook_url: str = Field(
        "", description="a URL that receives every incident state as its v1 JSON (POST)"
    )
    public_url: str = Field(
        "", description="the API's URL as on-call engineers reach it, for the links in alerts "
        "(default http://<api_host>:<api_port>)"
    )
    alert_resend_s: float = Field(60.0, gt=0, description="re-send open alerts this often")
    steps_encoding: Literal["v1", "v2"] = Field(
        "v1", description="how producers send ranks' steps: v1 JSON on flare.steps.v1, or v2 "
        "binary columns on flare.steps.v2 (about a third of the bytes; issue #17); the worker "
        "reads both"
    )
    shard_ranks: int = Field(
        0, ge=0, description="split each job's ranks into shards of this many (issue #17): "
        "producers key step messages by <job>/<shard> on flare.shardsteps.v1, `flare "
        "shard-worker`s assemble the shards, the job's worker merges them; 0: not split"
    )
    shard_partitions: int = Field(
        8, ge=1, description="partitions of flare.shardsteps.v1: how many shard workers can "
        "share the jobs' shards"
    )
    shard_group_id: str = "flare-shards"
    shard_alive_file: str = Field(
        "", description="a file `flare shard-worker` touches at most once a second while its "
        "loop runs, for a liveness check that reads its age (it serves no HTTP); empty: none"
    )
    rebuild_messages: int = Field(
        20_000, description="messages per input topic-partition re-read to rebuild detector "
        "state when a partition is assigned (0: start from scratch)"
    )

    def __repr_args__(self) -> Any:
        """The repr (and str) of the settings, with every URL that may carry a secret shown
        without it; the values themselves are untouched (SecretStr fields hide themselves)."""
        for name, value in super().__repr_args__():
            if name in _URLS and isinstance(value, str):
                value = redact_url(value, opaque=_URLS[name])
            yield name, value

    def kafka_connection(self, bootstrap: str | None = None) -> KafkaConnection:
        """The one Kafka connection every client of this process uses.

        `bootstrap` overrides the configured servers (the local tansu broker `flare up`
        started); empty settings mean that local broker's port on loopback.
        """
        return KafkaConnection(
            bootstrap=bootstrap or self.kafka_bootstrap or f"127.0.0.1:{self.kafka_port}",
            security_protocol=self.kafka_security_protocol,
            sasl_mechanism=self.kafka_sasl_mechanism,
            sasl_username=self.kafka_sasl_username,
            sasl_password=self.kafka_sasl_password,
            ssl_ca_location=self.kafka_ssl_ca_location,
            ssl_certificate_location=self.kafka_ssl_certificate_location,
            ssl_key_location=self.kafka_ssl_key_location,
            ssl_key_password=self.kafka_ssl_key_password,
        )
