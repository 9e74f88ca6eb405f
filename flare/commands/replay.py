"""`flare replay run.jsonl [--speed X]`: publish a recorded stream to Kafka.

`flare replay --kineto DIR` does the same for PyTorch profiler traces (one file per rank),
turned into steps messages; with `--out run.jsonl` they are recorded for `flare diagnose`
instead of published.

The recording's messages go out in file order, keyed by job, through the same idempotent,
murmur2-partitioned producer every Flare producer uses; `--speed` paces them by their own
timestamps (1 = real time), without it they go as fast as the broker takes them.
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("replay")
    def replay_cmd(
        recording: Path | None = typer.Argument(
            None, exists=True, dir_okay=False, help="a .jsonl (or .jsonl.gz) recording"),
        kineto: list[Path] | None = typer.Option(
            None, "--kineto", exists=True,
            help="PyTorch profiler traces: a folder (one file per rank) or files; repeatable"),
        job: str = typer.Option("kineto", help="job id of the replayed traces (with --kineto)"),
        out: Path | None = typer.Option(
            None, "--out", help="with --kineto: write a recording here instead of publishing"),
        speed: float | None = typer.Option(
            None, "--speed", min=0.0001,
            help="pace by the recorded timestamps, X times real time (default: no pacing)"),
        bootstrap: str | None = typer.Option(
            None, "--bootstrap", envvar="FLARE_KAFKA_BOOTSTRAP", show_envvar=True,
            help="Kafka host:port (default: the local broker of `flare up` on FLARE_KAFKA_PORT)"),
        create_topics: bool = typer.Option(
            True, "--create-topics/--no-create-topics",
            help="create missing flare topics (FLARE_PARTITIONS partitions) first"),
    ) -> None:
        """Publish a recorded stream (one Kafka message per line) to the broker."""
        from flare.local.broker import BrokerError, wait_for_broker
        from flare.settings import Settings
        from producers.kineto.replay import KinetoError, kineto_to_events
        from producers.live import publish_events
        from producers.publisher import KafkaPublisher, PublishError, for_steps
        from producers.recording import RecordingError, recording_events, write_events
        from schemas.topics import STAGE1_TOPICS
        from streams.kafka.topics import TopicError, check_shard_partitions, ensure_topics

        if (recording is None) == (not kineto):
            typer.echo("error: give a recording or --kineto DIR (not both)", err=True)
            raise typer.Exit(2)
        if out is not None and not kineto:
            typer.echo("error: --out goes with --kineto", err=True)
            raise typer.Exit(2)
        try:
            events = (
                list(kineto_to_events(kineto, job)) if kineto
                else recording_events(recording) if recording is not None else []
            )
        except KinetoError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        if out is not None:
            n = write_events(events, out)
            typer.echo(f"wrote {n} messages to {out}")
            return
        settings = Settings()
        conn = settings.kafka_connection(bootstrap)
        publisher: KafkaPublisher | None = None
        try:
            wait_for_broker(conn, timeout_s=15.0)
            if create_topics:
                ensure_topics(conn, settings.partitions)
                if settings.shard_ranks:
                    check_shard_partitions(
                        ensure_topics(conn, settings.shard_partitions, topics=STAGE1_TOPICS),
                        settings.shard_partitions)
            publisher = KafkaPublisher(conn)
            summary = publish_events(events, for_steps(
                publisher, shard_ranks=settings.shard_ranks, partitions=settings.shard_partitions,
                encoding=settings.steps_encoding), speed)
            stats = publisher.flush()
        except RecordingError as exc:
            sent = publisher.flush().delivered if publisher is not None else 0
            typer.echo(f"error: {exc} ({sent} messages before it were published)", err=True)
            raise typer.Exit(2) from None
        except (BrokerError, TopicError, PublishError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None
        span = ""
        if summary.first_ts_ns is not None and summary.last_ts_ns is not None:
            span = f" spanning {(summary.last_ts_ns - summary.first_ts_ns) / 1e9:.1f} s"
        typer.echo(f"published {stats.delivered} messages{span} to {conn.bootstrap}")
