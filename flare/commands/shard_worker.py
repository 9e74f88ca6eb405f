"""`flare shard-worker`: stage 1 of jobs split across workers (issue #17).

Reads `flare.shardsteps.v1` in its own consumer group, assembles each (job, shard)'s step
and sends it to `flare.partials.v1`, where the job's `flare worker` merges the shards and
diagnoses the step. Run as many as `FLARE_SHARD_PARTITIONS`; they share the shards as a
consumer group does. Producers split a job with `FLARE_SHARD_RANKS` (the same value here).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import typer

from flare.settings import DetectorSettings, Settings


def run(settings: Settings, *, quiet: bool = True) -> int:
    """Run one stage-1 worker until SIGINT/SIGTERM; returns the records it read."""
    from flare.local.broker import wait_for_broker
    from schemas.topics import ALL_TOPICS, STAGE1_TOPICS
    from streams.kafka.shard_worker import ShardWorker, ShardWorkerConfig
    from streams.kafka.topics import check_shard_partitions, ensure_topics
    from streams.shard_stage import ShardStage

    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="flare shard-worker: %(message)s")
    conn = settings.kafka_connection()
    wait_for_broker(conn, timeout_s=settings.broker_wait_s)
    ensure_topics(conn, settings.partitions, topics=ALL_TOPICS)
    check_shard_partitions(ensure_topics(conn, settings.shard_partitions, topics=STAGE1_TOPICS),
                           settings.shard_partitions)
    detect = DetectorSettings()
    stage = ShardStage(max_message_bytes=settings.max_message_bytes, now_ns=time.time_ns,
                       shard_ranks=settings.shard_ranks, grace_s=detect.grace_s,
                       grace_steps=detect.grace_steps, idle_evict_s=settings.job_idle_s,
                       decoder_max_ranks=settings.decoder_cache_ranks)
    cfg = ShardWorkerConfig(group_id=settings.shard_group_id,
                            session_timeout_s=settings.kafka_session_timeout_s,
                            max_message_bytes=settings.max_message_bytes)
    worker = ShardWorker(conn, cfg, stage)
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    if not quiet:
        typer.echo(f"flare shard-worker: Kafka {conn.bootstrap}, shards of "
                   f"{settings.shard_ranks} ranks, group {cfg.group_id}", err=True)
    worker.run(lambda: stopping, alive_beat(settings.shard_alive_file, time.monotonic))
    typer.echo(f"flare shard-worker: read {worker.records} records, sent "
               f"{stage.partials_sent} shard steps, {stage.dead_letters.total} dead letters",
               err=True)
    return worker.records


def alive_beat(path: str, clock: Callable[[], float],
               every_s: float = 1.0) -> Callable[[], None] | None:
    """A beat that touches `path` at most every `every_s` of `clock`, or None (no path).

    The stage-1 worker serves no HTTP, so a container's health check reads this file's age:
    a loop stuck for longer than the check allows stops touching it."""
    if not path:
        return None
    file = Path(path)
    last = [float("-inf")]

    def beat() -> None:
        now = clock()
        if now - last[0] >= every_s:
            file.touch()
            last[0] = now

    return beat


def register(app: typer.Typer) -> None:
    @app.command("shard-worker")
    def shard_worker_cmd(
        bootstrap: str | None = typer.Option(
            None, "--bootstrap", envvar="FLARE_KAFKA_BOOTSTRAP", show_envvar=True,
            help="Kafka host:port (default: the local broker on FLARE_KAFKA_PORT)"),
        shard_ranks: int | None = typer.Option(
            None, "--shard-ranks", envvar="FLARE_SHARD_RANKS", show_envvar=True, min=1,
            help="ranks per shard, as the producers split jobs (required)"),
        quiet: bool = typer.Option(False, "--quiet", help="no banner"),
    ) -> None:
        """Stage 1 of split jobs: assemble each shard's step, send it to the job's worker."""
        overrides: dict[str, Any] = {"kafka_bootstrap": bootstrap, "shard_ranks": shard_ranks}
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
        if settings.shard_ranks < 1:
            typer.echo("flare shard-worker: set --shard-ranks (or FLARE_SHARD_RANKS) to the "
                       "producers' shard size", err=True)
            raise typer.Exit(2)
        from flare.local.broker import BrokerError
        from streams.kafka.topics import TopicError

        try:
            run(settings, quiet=quiet)
        except (BrokerError, TopicError) as exc:
            typer.echo(f"flare shard-worker: {exc}", err=True)
            raise typer.Exit(2) from None
