"""The rank side of the Unix socket to the node daemon: a daemon thread that never blocks training.

The training thread only appends a finished step to a bounded queue (`submit`); this thread
builds the v1 message, sends it, and every `interval_s` sends the rank's in-flight table,
which is what lets the daemon see a hang while the training thread is stuck inside a
collective (gloo and NCCL waits release the GIL). When the daemon is away (not started yet,
restarting) finished steps wait in the queue, up to `max_queued`, and are dropped and
counted only past that or when the process ends; reconnection is retried at most every
`retry_s`. A step whose send fails on an open connection is dropped and counted.

With GPU timing (`gpu`), this thread is also where a step's CUDA events are read: it waits
for them (bounded, `GpuTimer.resolve`) before building the step's message, so the training
thread never synchronises with the GPU for Flare.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from producers.torch_hook.buffer import RankMeta, StepCut, encode, steps_message
from producers.torch_hook.gpu_timing import GpuTimer
from producers.torch_hook.wire import BYE, HELLO, INFLIGHT, STEPS, FrameError, encode_frame


@dataclass(slots=True)
class ClientStats:
    sent_steps: int = 0
    dropped_steps: int = 0
    sent_inflight: int = 0
    connects: int = 0
    send_errors: int = 0
    build_errors: int = 0


class AgentClient:
    """Sends a rank's steps and in-flight tables to the daemon from a background thread.

    `meta` is called on the sender thread when a message is built (rank and coords may be
    learnt after install); `inflight` returns the current in-flight table.
    """

    def __init__(
        self,
        path: Path | str,
        meta: Callable[[], RankMeta | None],
        inflight: Callable[[], dict[str, Any]],
        *,
        interval_s: float = 1.0,
        retry_s: float = 2.0,
        send_timeout_s: float = 1.0,
        max_queued: int = 64,
        clock: Callable[[], int] = time.time_ns,
        gpu: GpuTimer | None = None,
    ) -> None:
        self.path = str(path)
        self.gpu = gpu
        self._meta = meta
        self._inflight = inflight
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.send_timeout_s = send_timeout_s
        self.max_queued = max_queued
        self.clock = clock
        self.stats = ClientStats()
        self._queue: deque[StepCut] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._next_connect = 0.0
        self._thread: threading.Thread | None = None
        # Why the process is ending, sent with the goodbye (`exits.ExitReporter`), and the
        # file faulthandler writes a fatal signal's stacks to, named in the hello.
        self.farewell: Callable[[], dict[str, Any] | None] = lambda: None
        self.fault_file = ""
        self.job_nodes = ""  # the job's nodes as a Slurm host list, sent in the hello

    # -- training thread -------------------------------------------------------------------
    def submit(self, cut: StepCut) -> bool:
        """Queue one finished step; False (and counted) when the queue is full."""
        if len(self._queue) >= self.max_queued:
            self.stats.dropped_steps += 1
            return False
        self._queue.append(cut)
        self._wake.set()
        return True

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flare-agent-client",
                                            daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (bounded by `timeout_s`), say goodbye, stop the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    # -- sender thread ---------------------------------------------------------------------
    def _run(self) -> None:
        last_table = 0.0
        while True:
            stopping = self._stop.is_set()
            self._drain()
            now = time.monotonic()
            if now - last_table >= self.interval_s or stopping:
                last_table = now
                self._send_table()
            if stopping:
                try:
                    bye = orjson.dumps(self.farewell() or {})
                except Exception:
                    bye = b"{}"
                self._send(BYE, bye)
                self._disconnect()
                self.stats.dropped_steps += len(self._queue)  # no daemon took them
                self._queue.clear()
                return
            self._wake.wait(max(0.0, self.interval_s - (time.monotonic() - last_table)))
            self._wake.clear()

    def _drain(self) -> None:
        while self._queue:
            try:
                meta = self._meta()
            except Exception:
                meta = None
            if meta is None:
                return  # identity unknown yet (no process group): keep the steps queued
            if self._connect() is None:
                # no daemon yet (a socket file bound but not listening, a restart): keep
                # them queued; dropping here lost a rank's first step under load
                return
            cut = self._queue.popleft()
            try:
                gpu = None
                if self.gpu is not None and cut.gpu:
                    gpu = self.gpu.resolve(cut.gpu, cut.boundary_ns - cut.t_start_ns)
                payload = encode(steps_message(meta, cut, self.clock(), gpu))
            except Exception:
                self.stats.build_errors += 1
                self.stats.dropped_steps += 1
                continue
            if self._send(STEPS, payload):
                self.stats.sent_steps += 1
            else:
                self.stats.dropped_steps += 1

    def _send_table(self) -> None:
        try:
            table = self._inflight()
        except Exception:
            return
        if self._send(INFLIGHT, orjson.dumps(table)):
            self.stats.sent_inflight += 1

    def _hello(self) -> bytes | None:
        meta = self._meta()
        if meta is None:
            return None
        hello: dict[str, Any] = {
            "job": meta.job, "rank": meta.rank, "local_rank": meta.local_rank,
            "node": meta.node, "world_size": meta.world_size, "pid": os.getpid(),
        }
        if self.fault_file:
            hello["fault_file"] = self.fault_file
        if self.job_nodes and meta.rank == 0:  # rank 0's agent starts the job
            hello["job_nodes"] = self.job_nodes
        return orjson.dumps(hello)

    def _connect(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        now = time.monotonic()
        if now < self._next_connect:
            return None
        hello = self._hello()
        if hello is None:
            # No identity yet: nothing was tried, so no retry pause either. Pausing here made
            # the first step of every rank wait out the pause taken by the in-flight table
            # sent before the process group existed, and that step was dropped.
            return None
        self._next_connect = now + self.retry_s
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.send_timeout_s)
        try:
            s.connect(self.path)
            s.sendall(encode_frame(HELLO, hello))
        except OSError:
            s.close()
            return None
        self.stats.connects += 1
        self._sock = s
        return s

    def _send(self, ftype: int, payload: bytes) -> bool:
        try:
            frame = encode_frame(ftype, payload)
        except FrameError:
            self.stats.build_errors += 1  # too big for one frame: drop it, keep the socket
            return False
        s = self._connect()
        if s is None:
            return False
        try:
            s.sendall(frame)
            return True
        except (OSError, ValueError):
            self.stats.send_errors += 1
            self._disconnect()
            return False

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
