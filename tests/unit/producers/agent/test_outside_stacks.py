"""A stopped rank's stacks read from outside it: py-spy's dump, parsed as the hook's stacks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from producers.agent import outside_stacks as outside_stacks_module
from producers.agent.outside_stacks import OutsideStacks, outside_stacks, parse_dump, py_spy

# a stand-in for a training rank: its main thread spins in a function of its own, and it
# says when it is there (a stopped process is read, not asked)
_RANK = """
import sys
def load_batch():
    print("ready", flush=True)
    while True:
        sum(range(1000))
def step():
    load_batch()
step()
"""


def test_a_stopped_process_is_read_where_it_stopped_outermost_frame_first() -> None:
    """py-spy (installed with Flare) reads a SIGSTOPped child's main thread without
    resuming it: the frames end in the function it stopped in."""
    reader = outside_stacks()
    assert reader is not None, "py-spy is a dependency of the agent"
    child = subprocess.Popen([sys.executable, "-c", _RANK], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.1)
        stacks = reader(child.pid)
        assert Path(f"/proc/{child.pid}/stat").read_text().split(")")[1].split()[0] == "T"
    finally:
        child.kill()
        child.wait()
    assert stacks is not None
    main = stacks[0]
    assert main.training and main.thread == "MainThread"
    assert [f.rsplit(" in ", 1)[1] for f in main.frames[-3:]] == [
        "<module>", "step", "load_batch"]


def test_the_hooks_own_thread_is_left_out_and_names_are_the_functions_own() -> None:
    hook = str(Path(outside_stacks_module.__file__).resolve().parents[1] / "torch_hook")
    dump = json.dumps([
        {"os_thread_id": 9, "thread_name": "flare-agent-client", "frames": [
            {"name": "Condition.wait", "filename": "/usr/lib/threading.py", "line": 331},
            {"name": "Sender.run", "filename": f"{hook}/client.py", "line": 50}]},
        {"os_thread_id": 7, "thread_name": None, "frames": [
            {"name": "Wrapped.all_reduce", "filename": f"{hook}/patch.py", "line": 80},
            {"name": "main.<locals>.Stage.forward", "filename": "/x/train.py", "line": 9}]}])
    (only,) = parse_dump(dump, pid=7)
    assert (only.thread, only.frames, only.training) == ("MainThread", ["train.py:9 in forward"],
                                                         True)


def test_what_cannot_be_read_is_nothing_not_an_error() -> None:
    def failed(*_a: object, **_k: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess([], 1, "", "Error: Permission denied")

    def hung(*_a: object, **_k: object) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired("py-spy", 2.0)

    def garbled(*_a: object, **_k: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess([], 0, "not json", "")

    for run in (failed, hung, garbled):
        assert OutsideStacks("py-spy", run=run)(123) is None
    assert OutsideStacks("/nonexistent/py-spy")(123) is None


def test_py_spy_is_found_beside_the_interpreter_first(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    exe = tmp_path / "py-spy"
    exe.write_text("")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert py_spy() == str(exe)
