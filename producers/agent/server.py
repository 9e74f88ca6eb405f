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
from producers.publisher import Publisher
from producers.torch_hook.wire import BYE, HEADER, FrameError, decode_header

log = logging.getLogger("flare.agent")


class AgentDaemon:
    """The Unix socket server of one node; `serve()` runs until `stop` is set."""

    def __init__(self, core: AgentCore, outbox: Outbox, socket_path: Path | str, *,
                 interval_s: float | None = None) -> None:
        self.core = core
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
        try:
            await stop.wait()
        finally:
            beat.cancel()
            server.close()
            await server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            await asyncio.to_thread(self.outbox.close)

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
                    max_messages: int = 100_000) -> AgentDaemon:
    """Build and run an agent until `stop` (a new event when None: runs until cancelled).

    ValueError when the cadence is invalid (see `Cadence`).
    """
    cadence = Cadence(interval_s=interval_s, keepalive_s=keepalive_s, long_op_s=long_op_s)
    daemon = AgentDaemon(AgentCore(node, cadence=cadence),
                         Outbox(publisher, max_messages=max_messages), socket_path)
    await daemon.serve(stop or asyncio.Event())
    return daemon
