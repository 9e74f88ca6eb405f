"""`flare agent`: the node daemon that ships local ranks' steps and heartbeats to Kafka."""

from __future__ import annotations

import socket
from pathlib import Path

import typer

from producers.agent.cadence import INTERVAL_S, KEEPALIVE_S, LONG_OP_S


def register(app: typer.Typer) -> None:
    @app.command("agent")
    def agent_cmd(
        socket_path: Path = typer.Option(
            None, "--socket", envvar="FLARE_AGENT_SOCKET", show_envvar=True,
            help="Unix socket the ranks connect to (default: flare-agent.sock in "
                 "$XDG_RUNTIME_DIR, else in the temp folder)",
        ),
        node: str = typer.Option(
            "", envvar="FLARE_NODE", show_envvar=True, help="node name [default: host name]",
        ),
        interval_s: float = typer.Option(
            INTERVAL_S, "--interval", envvar="FLARE_AGENT_INTERVAL_S", show_envvar=True,
            help="seconds between heartbeat samples of each rank",
        ),
        keepalive_s: float = typer.Option(
            KEEPALIVE_S, "--keepalive-s", envvar="FLARE_AGENT_KEEPALIVE_S", show_envvar=True,
            help="publish a rank's heartbeat at least this often; in between only when its "
                 "set of long in-flight ops changes (keepalive + long-op must stay below the "
                 "10 s hang timeout)",
        ),
        long_op_s: float = typer.Option(
            LONG_OP_S, "--long-op-s", envvar="FLARE_AGENT_LONG_OP_S", show_envvar=True,
            help="an op in flight this long is 'long': its start and end are published at once",
        ),
        max_messages: int = typer.Option(
            100_000, envvar="FLARE_AGENT_MAX_MESSAGES", show_envvar=True,
            help="bound of the outgoing queue; beyond it messages are dropped and counted",
        ),
        dry_run: bool = typer.Option(
            False, "--dry-run", help="print messages to stdout instead of publishing to Kafka",
        ),
        topology_map: str = typer.Option(
            "", "--topology-map", envvar="FLARE_TOPOLOGY", show_envvar=True,
            help="the node → leaf switch map inline, node=switch pairs separated by commas "
                 "(wins over --topology)",
        ),
        topology: Path = typer.Option(
            None, "--topology", envvar="FLARE_TOPOLOGY_FILE", show_envvar=True,
            dir_okay=False, help="node → leaf switch map: JSON or a Slurm topology.conf "
                                 "[default: /etc/slurm/topology.conf when it exists]",
        ),
        metrics_port: int = typer.Option(
            0, "--metrics-port", envvar="FLARE_AGENT_METRICS_PORT", show_envvar=True,
            min=0, max=65535, help="serve the node's per-rank Prometheus metrics on this port "
                                   "(GET /metrics; 0: off)",
        ),
        record: Path = typer.Option(
            None, "--record", dir_okay=False,
            help="also append every message published to Kafka to this recording (.jsonl): "
                 "the node's own copy of what it sent",
        ),
    ) -> None:
        """Run the node daemon: one per node, ranks reach it with the torch hook."""
        import asyncio
        import signal
        import sys

        from flare.settings import Settings
        from producers.agent.cadence import Cadence
        from producers.agent.server import run_agent
        from producers.agent.topology import TopologyError, load_topology
        from producers.publisher import KafkaPublisher, Publisher, TeePublisher, for_steps
        from producers.recording import RecordingPublisher
        from producers.torch_hook.wire import default_socket_path

        try:
            Cadence(interval_s=interval_s, keepalive_s=keepalive_s, long_op_s=long_op_s)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        settings = Settings()
        try:
            switch_of_node = load_topology(topology_map, topology)
        except TopologyError as exc:
            typer.echo(f"error: topology: {exc}", err=True)
            raise typer.Exit(2) from None
        path = socket_path or default_socket_path()
        if dry_run and record is not None:
            typer.echo("error: --dry-run prints what it would publish; --record needs Kafka",
                       err=True)
            raise typer.Exit(2)
        publisher: Publisher
        if dry_run:
            publisher = RecordingPublisher(sys.stdout.buffer)
        else:
            # a split job's steps go to Kafka keyed by shard; the recording keeps them as
            # flare.steps.v1, which `flare diagnose` and `flare replay` read
            try:
                publisher = for_steps(
                    KafkaPublisher(settings.kafka_connection(),
                                   max_message_bytes=settings.max_message_bytes),
                    shard_ranks=settings.shard_ranks, partitions=settings.shard_partitions,
                    encoding=settings.steps_encoding)
            except ValueError as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from None
            if record is not None:
                try:
                    copy = open(record, "ab")  # noqa: SIM115 - open for the agent's life
                except OSError as exc:
                    typer.echo(f"error: cannot write {record}: {exc.strerror}", err=True)
                    raise typer.Exit(2) from None
                publisher = TeePublisher(publisher, RecordingPublisher(copy))

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            typer.echo(f"flare agent listening on {path}", err=True)
            await run_agent(publisher, path, node or socket.gethostname(),
                            interval_s=interval_s, keepalive_s=keepalive_s,
                            long_op_s=long_op_s, stop=stop, max_messages=max_messages,
                            switch_of_node=switch_of_node, metrics_port=metrics_port,
                            version=_version())

        asyncio.run(main())
        sys.stdout.flush()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flare-diagnosis")
    except PackageNotFoundError:
        return "unknown"
