"""The local protocol between a training rank's hook and its node daemon (`flare agent`).

A Unix stream socket carries frames: a 4-byte big-endian length, then one type byte, then a
JSON payload. Framing is ours (not Kafka's) because the hook must stay dependency-free and
cheap, and because a stream socket tells the daemon at once when a rank's process dies.

Frame types:
- HELLO ``{"job","rank","local_rank","node","world_size","pid"[,"fault_file","job_nodes"]}``:
  first frame of every connection; the daemon keys the rank's state on (job, rank).
  `fault_file` is where a fatal signal's stacks are written (`exits`); `job_nodes` (rank 0)
  is the job's node list as a Slurm host list, which the job's start event carries.
- STEPS: one complete wire-v1 `flare.steps.v1` message, forwarded to Kafka as is.
- INFLIGHT ``{"step","inflight":[{"group","name","seq","start_ns"}][,"stacks","stacks_ts_ns"]
  [,"layout"]}``: the rank's table of ops in flight, sent about every second; the daemon turns
  it into heartbeats. `stacks` (every thread's Python stack, `torch_hook.stacks`) rides along
  once when the rank's step has lasted far past its usual time. `layout` (``{"tp": 8, ...}``,
  members per group of each tagged kind) is what rank 0's daemon starts the job with again
  once it is known: the process group, and so the hello, exists before the groups do.
- BYE ``{}`` or ``{"exit","detail","stack"}``: the rank ends; cleanly (the job's end, when
  it is rank 0) unless it says why it is exiting (an unhandled exception).
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

HELLO = 1
STEPS = 2
INFLIGHT = 3
BYE = 4
FRAME_TYPES = frozenset({HELLO, STEPS, INFLIGHT, BYE})

HEADER = struct.Struct(">IB")  # payload length (excluding the type byte), frame type
MAX_FRAME_BYTES = 16 * 1024 * 1024
SOCKET_NAME = "flare-agent.sock"


class FrameError(ValueError):
    """A peer sent a frame that breaks the protocol (the connection is then closed)."""


def default_socket_path() -> Path:
    """Where the daemon listens when nobody says otherwise (same rule on both sides)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / SOCKET_NAME


def encode_frame(ftype: int, payload: bytes) -> bytes:
    """One frame: header then payload."""
    if ftype not in FRAME_TYPES:
        raise FrameError(f"unknown frame type {ftype}")
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(payload), ftype) + payload


def decode_header(header: bytes) -> tuple[int, int]:
    """(payload length, frame type) of a header; FrameError when it cannot be a frame."""
    length, ftype = HEADER.unpack(header)
    if ftype not in FRAME_TYPES:
        raise FrameError(f"unknown frame type {ftype}")
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return length, ftype
