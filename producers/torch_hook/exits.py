"""Exit reports: why a rank's process ended, for the node daemon to pass on.

The first rank to die is the incident; its peers only fail after it. The daemon sees a
socket close, but not why. Two causes can still say so themselves:
- an unhandled exception: `sys.excepthook` records its type, message and stack, and the
  goodbye the hook sends at exit carries them (the daemon then reports the exit instead of
  a clean end);
- a fatal signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL): Python's `faulthandler` writes
  the stacks of every thread to a file named in the rank's hello; the daemon reads it when
  the socket closes without a goodbye.
A SIGKILL (the OOM killer, a scheduler) leaves neither: the daemon reports the rank as gone.

A `faulthandler` the script enabled itself is left alone (its output is the user's), and so
is an excepthook installed after ours (it calls ours only if it chains).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import tempfile
import traceback
from pathlib import Path
from types import TracebackType
from typing import IO, Any

MAX_FRAMES = 20  # innermost frames of a stack kept in a report
MAX_TEXT = 500  # characters of an exception message kept


def frame_lines(tb: TracebackType | None) -> list[str]:
    """`file:line in function` for the innermost `MAX_FRAMES` frames, outermost first."""
    return [f"{Path(f.filename).name}:{f.lineno} in {f.name}"
            for f in traceback.extract_tb(tb)[-MAX_FRAMES:]]  # fmt: skip


class ExitReporter:
    """Installs the excepthook and the fault file of one hook; `report` is what it found."""

    def __init__(self, socket_path: Path | str) -> None:
        self.socket_path = Path(socket_path)
        self.report: dict[str, Any] | None = None  # set by an unhandled exception
        self.fault_file = ""  # where faulthandler writes, told to the daemon in the hello
        self._fault_fh: IO[str] | None = None
        self._previous: Any = None

    def install(self) -> None:
        if self._previous is not None:
            return
        self._previous = sys.excepthook
        sys.excepthook = self._on_exception
        if not faulthandler.is_enabled():
            self._open_fault_file()

    def uninstall(self) -> None:
        if self._previous is not None and sys.excepthook == self._on_exception:
            sys.excepthook = self._previous
        self._previous = None
        if self._fault_fh is not None:
            faulthandler.disable()
            with contextlib.suppress(OSError):
                self._fault_fh.close()
                os.unlink(self.fault_file)
            self._fault_fh, self.fault_file = None, ""

    def _open_fault_file(self) -> None:
        """A file next to the daemon's socket (the daemon reads it), else in the temp dir."""
        name = f"flare-fault-{os.getpid()}.txt"
        for folder in (self.socket_path.parent, Path(tempfile.gettempdir())):
            try:
                fh = open(folder / name, "w")  # noqa: SIM115 - open for the process's life
            except OSError:
                continue
            faulthandler.enable(file=fh, all_threads=True)
            self._fault_fh, self.fault_file = fh, str(folder / name)
            return

    def _on_exception(self, kind: type[BaseException], value: BaseException,
                      tb: TracebackType | None) -> None:
        with contextlib.suppress(Exception):
            if not issubclass(kind, KeyboardInterrupt):  # Ctrl-C is a stop, not a crash
                detail = f"{kind.__name__}: {value}"[:MAX_TEXT]
                self.report = {"exit": "exception", "detail": detail,
                               "stack": frame_lines(tb)}  # fmt: skip
        (self._previous or sys.__excepthook__)(kind, value, tb)
