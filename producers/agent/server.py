"""The agent process: a Unix socket server for the node's ranks, and its heartbeat timer.

All decisions are the core's (`producers.agent.core`); this module only moves bytes between
the ranks' sockets, the core and the outbox, on one asyncio loop, so a slow or dead rank
never holds up the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from producers.agent.cadence import INTERVAL_S, KEEPALIVE_S, LONG_OP_S, Cadence
from producers.agent.core import AgentCore
from producers.agent.outbox import Outbox
from producers.agent.outside_stacks import outside_stacks
from producers.publisher import Publisher
from producers.torch_hook.wire import BYE, HEADER, FrameError, decode_header

log = logging.getLogger("flare.agent")


class AgentDaemon:
    """The Unix socket server of one node; `serve()` runs until `stop` is set."""

    def __init__(self, core: AgentCore, outbox: Outbox, socket_path: Path | str, *,
                 interval_s: float | None = None, metrics_port: int = 0,
                 metrics_host: str = "0.0.0.0", version: str = "") -> None:  # noqa: S104
        self.core = core
        self.metrics_port = metrics_port  # 0: no metrics endpoint
        self.metrics_host = metrics_host
        self.version = version
        self.metrics_bound: int | None = None  # the port it listens on (when asked for 0…)
        self.outbox = outbox
        self.socket_path = Path(socket_path)
        # the sampling period; the core's cadence one unless told otherwise
        self.interval_s = core.cadence.interval_s if interval_s is None else interval_s
        self._next_conn = 0

    async def serve(self, stop: asyncio.Event) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = await asyncio.start_unix_server(self._client, path=str(self.socket_path))
        os.chmod(self.socket_path, 0o666)  # ranks may run as other users of the node
        self.outbox.start()
        beat = asyncio.create_task(self._beat(stop))
        http = None
        if self.metrics_port:
            http = await asyncio.start_server(self._scrape, self.metrics_host, self.metrics_port)
            self.metrics_bound = http.sockets[0].getsockname()[1]
        try:
            await stop.wait()
        finally:
            beat.cancel()
            server.close()
            await server.wait_closed()
            if http is not None:
                http.close()
                await http.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            await asyncio.to_thread(self.outbox.close)

    async def _scrape(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """GET /metrics (HTTP/1.0, one request per connection): what Prometheus asks."""
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            line = request.split(b"\r\n", 1)[0].split()
            if len(line) >= 2 and line[0] in (b"GET", b"HEAD") and line[1].split(b"?")[0] == (
                    b"/metrics"):
                body = self.core.metrics_text(self.outbox.stats.dropped,
                                              self.version).encode()
                head = (b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4; "
                        b"charset=utf-8\r\n")
            else:
                body = b"not found: the agent serves /metrics\n"
                head = b"HTTP/1.0 404 Not Found\r\n"
            head += b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
            writer.write(head + (body if line and line[0] != b"HEAD" else b""))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _beat(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.interval_s)
            self.outbox.put(self.core.heartbeats())

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self._next_conn
        self._next_conn += 1
        broken = False
        try:
            while True:
                header = await reader.readexactly(HEADER.size)
                length, ftype = decode_header(header)
                payload = await reader.readexactly(length)
                self.outbox.put(self.core.on_frame(conn, ftype, payload))
                if ftype == BYE:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except FrameError as exc:
            self.core.stats.bad_frames += 1
            broken = True
            log.warning("closing connection %d: %s", conn, exc)
        finally:
            self.outbox.put(self.core.on_disconnect(conn, broken=broken))
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def run_agent(publisher: Publisher, socket_path: Path | str, node: str, *,
                    interval_s: float = INTERVAL_S, keepalive_s: float = KEEPALIVE_S,
                    long_op_s: float = LONG_OP_S, stop: asyncio.Event | None = None,
                    max_messages: int = 100_000,
                    switch_of_node: dict[str, str] | None = None, metrics_port: int = 0,
                    version: str = "") -> AgentDaemon:
    """Build and run an agent until `stop` (a new event when None: runs until cancelled).
    `switch_of_node`: the cluster's topology, sent in the job start events it publishes;
    `metrics_port`: serve the node's Prometheus metrics there (0: not at all).

    ValueError when the cadence is invalid (see `Cadence`).
    """
    cadence = Cadence(interval_s=interval_s, keepalive_s=keepalive_s, long_op_s=long_op_s)
    core = AgentCore(node, cadence=cadence, switch_of_node=switch_of_node,
                     read_stacks=outside_stacks())
    daemon = AgentDaemon(core,
                         Outbox(publisher, max_messages=max_messages), socket_path,
                         metrics_port=metrics_port, version=version)
    await daemon.serve(stop or asyncio.Event())
    return daemon
