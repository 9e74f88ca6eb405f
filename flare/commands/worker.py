"""`flare worker`: consume the flare topics, diagnose each job, store and publish the results.

This module is the composition root of a worker process: it builds the settings, the Kafka
connection, the ClickHouse client, the sink, the pipeline and the faust app, and (unless
`--no-api`) serves the HTTP API from the same process and loop, which embedded chDB requires
(one process owns its data directory). Settings are read here and handed down as plain
values (`WorkerConfig`, `DetectorConfig`, `KafkaConnection`): the stream code reads none.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from flare import __version__
from flare.settings import Settings

if TYPE_CHECKING:
    from pydantic import SecretStr

    from storage.adhoc import ReadOnlySQL
    from streams.worker import WorkerConfig

log = logging.getLogger("flare.worker")


def _settings(**overrides: Any) -> Settings:
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def worker_config(settings: Settings) -> WorkerConfig:
    """The worker's consuming knobs, from the settings."""
    from streams.worker import WorkerConfig

    return WorkerConfig(
        group_id=settings.group_id,
        partitions=settings.partitions,
        max_message_bytes=settings.max_message_bytes,
        session_timeout_s=settings.kafka_session_timeout_s,
        fetch_max_wait_ms=settings.kafka_fetch_max_wait_ms,
        rebuild_messages=settings.rebuild_messages,
        shutdown_write_s=settings.worker_shutdown_write_s,
    )


def notifier(settings: Settings) -> Any:
    """Where the worker sends its incidents as alerts (None when nowhere is configured)."""
    from streams.alerts import AlertTargets, Notifier, httpx_post

    targets = AlertTargets(
        alertmanager_url=settings.alertmanager_url, webhook_url=settings.webhook_url,
        incident_base_url=settings.public_url or f"http://{settings.api_host}:{settings.api_port}",
        resend_s=settings.alert_resend_s)
    return Notifier(targets, httpx_post(), time.time_ns) if targets.enabled else None


def build_api(db: Any, pipeline: Any, api_key: SecretStr | None = None,
              sql: ReadOnlySQL | None = None) -> Any:
    """The FastAPI app over `db`, with readiness from the pipeline's watchdog and the
    worker's own counters at /worker/stats (open like /metrics: counters, no job's data;
    /v1 needs `api_key` when one is set), and POST /v1/sql over `sql`, a read-only session
    (`storage.adhoc`): the worker owns an embedded store, so SQL reaches it only here."""
    from api.app import create_app
    from streams.worker import memory_in_use

    def ready() -> tuple[bool, str]:
        r = pipeline.readiness()
        return r.ready, r.reason

    app = create_app(db, ready, more_metrics=pipeline.metrics_text, api_key=api_key, sql=sql)

    @app.get("/worker/stats", tags=["health"])
    async def worker_stats() -> dict[str, Any]:
        """This worker's counters: records, dead letters by topic and cause, lag per
        partition, jobs held, and the memory its allocators hold live (`memory`). (async:
        it runs on the worker's loop, never concurrently with the pipeline it reads.)"""
        return {**pipeline.snapshot(), "memory": memory_in_use()}

    return app


def run(settings: Settings, *, serve_api: bool = True, quiet: bool = True) -> None:
    """Run one worker until SIGINT/SIGTERM."""
    from detectors.diagnoser import JobDiagnoser
    from flare.local.broker import wait_for_broker
    from flare.settings import DetectorSettings
    from storage.adhoc import open_readonly
    from storage.client import connect_when_ready
    from storage.migrations import apply_schema
    from storage.writer import Sink
    from streams.kafka.topics import ensure_topics
    from streams.pipeline import build_pipeline
    from streams.worker import ApiServer, build_app, run_faust

    conn = settings.kafka_connection()
    wait_for_broker(conn, timeout_s=settings.broker_wait_s)
    ensure_topics(conn, settings.partitions)
    db = connect_when_ready(settings.clickhouse_url, settings.clickhouse_password, timeout_s=60.0,
                            connect_timeout_s=settings.clickhouse_connect_timeout_s,
                            read_timeout_s=settings.clickhouse_read_timeout_s)
    apply_schema(db)
    detector_config = DetectorSettings().config()
    pipeline = build_pipeline(
        # the worker writes full buffers on a thread of its own (streams.storing), never on
        # the loop that adds the rows
        Sink(db, flush_when_full=False),
        lambda job: JobDiagnoser(job, detector_config),
        max_message_bytes=settings.max_message_bytes,
        stall_after_s=settings.worker_stall_s,
        job_idle_s=settings.job_idle_s,
        now_s=time.monotonic,
        decoder_cache_ranks=settings.decoder_cache_ranks,
        wall_ns=time.time_ns,
        version=__version__,
        write_stall_s=settings.clickhouse_write_stall_s,
    )
    api = None
    sql = None
    if serve_api:
        sql = open_readonly(settings.clickhouse_url, settings.clickhouse_password)
        api = ApiServer(build_api(db, pipeline, settings.api_key, sql), settings.api_host,
                        settings.api_port)
    if not quiet:
        where = f", API on http://{settings.api_host}:{settings.api_port}" if api else ""
        typer.echo(f"flare worker: Kafka {conn.bootstrap}, ClickHouse {db.location}{where}",
                   err=True)
    try:
        with tempfile.TemporaryDirectory(prefix="flare-faust-") as scratch:
            app = build_app(worker_config(settings), conn, pipeline, datadir=Path(scratch),
                            api=api, notifier=notifier(settings))
            run_faust(app, loglevel=settings.log_level, quiet=quiet)
    finally:
        if sql is not None:
            sql.close()
        db.close()


def register(app: typer.Typer) -> None:
    @app.command("worker")
    def worker_cmd(
        bootstrap: str | None = typer.Option(
            None, "--bootstrap", envvar="FLARE_KAFKA_BOOTSTRAP", show_envvar=True,
            help="Kafka host:port (default: the local broker on FLARE_KAFKA_PORT)"),
        clickhouse_url: str | None = typer.Option(
            None, "--clickhouse-url", envvar="FLARE_CLICKHOUSE_URL", show_envvar=True,
            help="chdb:///path or http(s)://user@host:port/db (default chdb:///./data/chdb)"),
        partitions: int | None = typer.Option(
            None, "--partitions", envvar="FLARE_PARTITIONS", show_envvar=True,
            help="partitions of the topics it creates (default 4)"),
        group_id: str | None = typer.Option(
            None, "--group-id", envvar="FLARE_GROUP_ID", show_envvar=True,
            help="consumer group (default flare-worker)"),
        api: bool = typer.Option(True, "--api/--no-api", help="serve the HTTP API in this process"),
        api_host: str | None = typer.Option(
            None, "--api-host", envvar="FLARE_API_HOST", show_envvar=True,
            help="interface of the API (default 127.0.0.1)"),
        api_port: int | None = typer.Option(
            None, "--api-port", envvar="FLARE_API_PORT", show_envvar=True,
            help="port of the API (default 8000)", min=1, max=65535),
        log_level: str | None = typer.Option(
            None, "--log-level", envvar="FLARE_LOG_LEVEL", show_envvar=True,
            help="crit|error|warn|info|debug (default warn)"),
        quiet: bool = typer.Option(False, "--quiet", help="no banner"),
    ) -> None:
        """Consume steps, heartbeats and job events; diagnose; store; publish incidents."""
        settings = _settings(
            kafka_bootstrap=bootstrap, clickhouse_url=clickhouse_url, partitions=partitions,
            group_id=group_id, api_host=api_host, api_port=api_port, log_level=log_level,
        )
        from flare.local.broker import BrokerError
        from storage.client import StorageError

        try:
            run(settings, serve_api=api, quiet=quiet)
        except (BrokerError, StorageError) as exc:  # nothing to serve without them
            typer.echo(f"flare worker: {exc}", err=True)
            raise typer.Exit(2) from None
