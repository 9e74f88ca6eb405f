"""A stopped rank's Python stacks, read from outside its process.

The hook sends a rank's stacks from inside it (`producers.torch_hook.stacks`), which needs the
rank to run. A rank frozen by a cgroup freezer, stopped by SIGSTOP or stuck in uninterruptible
sleep cannot: it is the one rank of a hang whose place in the code matters most, and the
hook can never say it. Its memory can still be read. `py-spy dump --nonblocking` reads the
interpreter's frames from the process's memory without stopping or signalling it (no ptrace
attach, which would wait on a frozen task), in tens of milliseconds. The agent does this
once, when it first sees a rank's process unable to run (`AgentCore.heartbeats`), and sends the
stacks with the heartbeat that says so.

It needs the right to read another process's memory: root, or `CAP_SYS_PTRACE` where the
kernel's Yama policy limits it to descendants (a container needs that capability added).
Without py-spy, or without the right, nothing is read and the rank shows as before: a
process that cannot answer.

>>> dump = '[{"os_thread_id": 7, "thread_name": null, "frames": ['
>>> dump += '{"name": "all_reduce", "filename": "/x/distributed_c10d.py", "line": 2},'
>>> dump += '{"name": "Trainer.main", "filename": "/x/train.py", "line": 9}]}]'
>>> [(t.thread, t.frames, t.training) for t in parse_dump(dump, pid=7)]
[('MainThread', ['train.py:9 in main', 'distributed_c10d.py:2 in all_reduce'], True)]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from schemas.wire import ThreadStack

MAX_THREADS = 16
MAX_FRAMES = 40  # innermost frames per thread, as the hook sends
TIMEOUT_S = 2.0  # a dump takes tens of ms; one that does not return is given up
# the hook's own frames say nothing of training (the hook leaves them out as well)
_HOOK = str(Path(__file__).resolve().parents[1] / "torch_hook")

Run = Callable[..., subprocess.CompletedProcess[str]]


def py_spy() -> str | None:
    """The py-spy executable: beside this interpreter (installed with Flare), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def parse_dump(text: str, pid: int) -> list[ThreadStack]:
    """py-spy's JSON dump as the stacks a hook sends: outermost frame first, `file:line in
    function` with the file's name only, the main thread (`pid`'s own) as the training
    thread and first, the hook's frames left out."""
    out: list[ThreadStack] = []
    for t in json.loads(text):
        every = list(reversed(t.get("frames") or []))
        frames = [f for f in every if not str(f.get("filename", "")).startswith(_HOOK)]
        main = t.get("os_thread_id") == pid
        if not main and len(frames) < len(every):
            continue  # the hook's own thread (its sender): it says nothing of training
        name = "MainThread" if main else (t.get("thread_name")
                                           or f"thread-{t.get('os_thread_id')}")
        out.append(ThreadStack(
            str(name)[:200],
            [_frame_text(f) for f in frames[-MAX_FRAMES:]],
            main))
    out.sort(key=lambda s: (not s.training, s.thread))
    return out[:MAX_THREADS]


def _frame_text(frame: dict[str, Any]) -> str:
    """As the hook writes a frame: the function's own name, not py-spy's qualified one
    (`Module._call_impl`), so a stopped rank's frames merge with its peers' where they
    are the same."""
    name = str(frame.get("name", "?")).rsplit(".", 1)[-1]
    return f"{Path(str(frame.get('filename', '?'))).name}:{frame.get('line', 0)} in {name}"[:300]


class OutsideStacks:
    """Read process `pid`'s Python stacks with py-spy; None when it cannot be read.

    `run` is the subprocess seam (tests give a fake)."""

    def __init__(self, exe: str, timeout_s: float = TIMEOUT_S,
                 run: Run = subprocess.run) -> None:
        self.exe = exe
        self.timeout_s = timeout_s
        self._run = run

    def __call__(self, pid: int) -> list[ThreadStack] | None:
        try:
            done = self._run([self.exe, "dump", "--pid", str(pid), "--nonblocking", "--json"],
                             capture_output=True, text=True, timeout=self.timeout_s,
                             check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None  # gone, not Python, or not allowed to read it
        try:
            return parse_dump(done.stdout, pid) or None
        except (ValueError, TypeError, AttributeError):
            return None


def outside_stacks() -> OutsideStacks | None:
    """The reader this node can use, or None without py-spy."""
    exe = py_spy()
    return OutsideStacks(exe) if exe else None
