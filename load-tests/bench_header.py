"""The two lines every benchmark prints first: how it was run, and on what.

A figure is only comparable with the command that made it, the machine, the library
versions that matter to it and how busy the machine was (BENCHMARKS.md quotes all four), so
the benchmarks print them the same way. Imported by the scripts beside it (their folder is
first on `sys.path` when one is run as a file).
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path


def header(**versions: str) -> str:
    """`command: …` and `machine: …`, with the versions given (numpy="2.4.6", …) and the
    load average now.

    >>> "cores, python" in header(numpy="2")
    True
    """
    load = os.getloadavg()
    command = f"python load-tests/{Path(sys.argv[0]).name} {shlex.join(sys.argv[1:])}"
    libs = "".join(f", {name} {v}" for name, v in versions.items())
    return (f"command: {command.rstrip()}\n"
            f"machine: {platform.machine()} {os.cpu_count()} cores, python "
            f"{platform.python_version()}{libs}, load average {load[0]:.2f} {load[1]:.2f} "
            f"{load[2]:.2f}")
