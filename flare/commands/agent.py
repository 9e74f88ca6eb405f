"""`flare agent`: the node daemon that ships local ranks' steps and heartbeats to Kafka."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
    ) -> None:
        """Run the node daemon: one per node, ranks reach it with the torch hook."""
        import asyncio
        import signal
        import sys

        from flare.settings import Settings
        from producers.agent.cadence import Cadence
        from producers.agent.server import run_agent
        from producers.publisher import KafkaPublisher, Publisher
        from producers.torch_hook.wire import default_socket_path

        try:
            Cadence(interval_s=interval_s, keepalive_s=keepalive_s, long_op_s=long_op_s)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        settings = Settings()
        path = socket_path or default_socket_path()
        publisher: Publisher
        if dry_run:
            publisher = _StdoutPublisher()
        else:
            publisher = KafkaPublisher(settings.kafka_connection(),
                                       max_message_bytes=settings.max_message_bytes)

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            typer.echo(f"flare agent listening on {path}", err=True)
            await run_agent(publisher, path, node or socket.gethostname(),
                            interval_s=interval_s, keepalive_s=keepalive_s,
                            long_op_s=long_op_s, stop=stop, max_messages=max_messages)

        asyncio.run(main())
        sys.stdout.flush()


class _StdoutPublisher:
    """Dry run: one recorded-stream line per message (DESIGN §3 `.jsonl`)."""

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any]) -> None:
        import orjson

        from producers.recording import recording_line

        k = key.decode() if isinstance(key, bytes) else key
        v = orjson.loads(value) if isinstance(value, bytes) else value
        typer.echo(recording_line(topic, k, v).decode(), nl=False)

    def flush(self, timeout_s: float = 30.0) -> None:
        return None
