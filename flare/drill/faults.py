"""Real faults, each applied and undone: a CPU quota, a freeze, a kill, a NIC rate limit.

These are the kernel's own mechanisms, not sleeps inside the training code:
- `CpuQuota`: a cgroup v1 `cpu` group whose CFS quota lets the process run only a fraction
  of one CPU. For a training rank this is the CPU analogue of a throttled GPU: everything it
  computes takes longer, and it never stops. A drill with fixed CPU shares also holds every
  rank to a share of its own with one, and nests the fault inside the slowed rank's share.
- `Freeze`: the cgroup v1 `freezer` (SIGSTOP where the freezer is missing): the process makes
  no progress at all, a hang.
- `Kill`: SIGKILL.
- `RateLimit`: a `tbf` qdisc on an interface: everything it sends is held to a rate. Shaping a
  NIC in both directions takes two (one on each end of a veth, or the NIC and its peer).
- `Flapping`: a `RateLimit` switched on and off on a period, on a thread of its own.
- `GpuClockLock`: one GPU's graphics clock locked low with `nvidia-smi -lgc`, the way a
  thermally or power-capped GPU runs; undone with `-rgc`. Only where the NVIDIA driver is:
  this project's machines have no GPU, so its tests run it against a fake `nvidia-smi`.

Every fault is idempotent to undo, and undoing leaves nothing behind (the cgroup directory is
removed, the qdisc deleted), so a drill or `flare chaos` can always clean up on exit.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

CGROUP_ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000  # the kernel takes no CFS quota or period below 1 ms


class FaultError(RuntimeError):
    """A fault could not be applied (no permission, no controller, no such process)."""


class Fault(Protocol):
    """What every fault does: start, and be undone (undo twice is harmless)."""

    def apply(self) -> None: ...

    def undo(self) -> None: ...


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise FaultError(f"cannot write {value!r} to {path}: {exc.strerror}") from None


def _procs_of(group: Path) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(x) for x in (group / "cgroup.procs").read_text().split()]
    return []


@dataclass(slots=True)
class _Cgroup:
    """A cgroup v1 directory of one controller holding `pid`, removed on `leave`.

    `name` may nest ("outer/inner", the outer group already there): a drill's slowed rank
    already has a CPU share of its own, and its fault must sit inside that share, not
    replace it. Leaving hands the process back to the group it came from, the parent.
    """

    controller: str
    name: str
    root: Path = CGROUP_ROOT

    @property
    def path(self) -> Path:
        return self.root / self.controller / self.name

    def enter(self, pid: int) -> None:
        base = self.root / self.controller
        if not (base / "cgroup.procs").exists():
            raise FaultError(f"no cgroup v1 '{self.controller}' controller at {base}")
        try:
            self.path.mkdir(exist_ok=True)
        except OSError as exc:
            raise FaultError(f"cannot create {self.path}: {exc.strerror}") from None
        try:
            _write(self.path / "cgroup.procs", str(pid))
        except FaultError:
            self.leave()  # no process (or not allowed): leave no empty group behind
            raise FaultError(f"cannot move process {pid} into {self.path}: no such process, "
                             "or not allowed") from None

    def leave(self) -> None:
        if not self.path.exists():
            return
        for pid in _procs_of(self.path):  # back to the parent (the controller's root)
            with contextlib.suppress(OSError):
                (self.path.parent / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            self.path.rmdir()


@dataclass(slots=True)
class CpuQuota:
    """Hold process `pid` (all its threads) to `cpus` of one CPU with a CFS quota.

    The same quota is a fault (a rank held below what it needs) or, in a drill with fixed CPU
    shares, each rank's share. A quota nested in another (`name` "share/fault") must not
    exceed it: cgroup v1 refuses a child's quota above its parent's.

    A quota is a budget per period: a process that was idle runs at full speed until it has
    spent its period's budget, then waits for the next. Over the usual 100 ms period a rank
    that waits on its peers computes a short op at full speed, and only a busy rank at
    `cpus`. `steady` takes the shortest period the kernel allows for the quota (1 ms of
    budget), so the process computes at `cpus` whether it was idle or not, as a GPU does:
    4 ms of work at 0.2 CPU took 5.9 ms after an idle gap and 8.1 ms back to back over
    100 ms, 19.5 and 19.7 ms over 5 ms (this project's 2 cores, beside a drill).
    """

    pid: int
    cpus: float
    name: str = "flare-cpu-quota"
    root: Path = CGROUP_ROOT
    steady: bool = False
    _group: _Cgroup = field(init=False)

    def __post_init__(self) -> None:
        if not 0.01 <= self.cpus <= 64:
            raise ValueError("cpus is a share of one CPU between 0.01 and 64")
        self._group = _Cgroup("cpu", self.name, self.root)

    @property
    def period_us(self) -> int:
        """The CFS period: the usual one, or with `steady` the shortest that gives 1 ms of
        quota (5 ms at 0.2 CPU; never below the kernel's 1 ms).

        >>> CpuQuota(1, 0.2).period_us, CpuQuota(1, 0.2, steady=True).period_us
        (100000, 5000)
        >>> CpuQuota(1, 0.1, steady=True).period_us, CpuQuota(1, 1.6, steady=True).period_us
        (10000, 1000)
        """
        if not self.steady:
            return CFS_PERIOD_US
        return max(MIN_QUOTA_US, math.ceil(MIN_QUOTA_US / self.cpus))

    @property
    def quota_us(self) -> int:
        return round(self.cpus * self.period_us)

    def apply(self) -> None:
        self._group.enter(self.pid)
        _write(self._group.path / "cpu.cfs_period_us", str(self.period_us))
        _write(self._group.path / "cpu.cfs_quota_us", str(self.quota_us))

    def undo(self) -> None:
        if self._group.path.exists():
            with contextlib.suppress(OSError):
                (self._group.path / "cpu.cfs_quota_us").write_text("-1")
        self._group.leave()


@dataclass(slots=True)
class Freeze:
    """Stop process `pid` with the cgroup freezer, or SIGSTOP where there is none."""

    pid: int
    name: str = "flare-freeze"
    root: Path = CGROUP_ROOT
    _group: _Cgroup = field(init=False)
    _signalled: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._group = _Cgroup("freezer", self.name, self.root)

    def apply(self) -> None:
        try:
            self._group.enter(self.pid)
        except FaultError:
            _signal(self.pid, signal.SIGSTOP)
            self._signalled = True
            return
        _write(self._group.path / "freezer.state", "FROZEN")

    def undo(self) -> None:
        if self._signalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            self._signalled = False
        if self._group.path.exists():
            with contextlib.suppress(OSError):
                (self._group.path / "freezer.state").write_text("THAWED")
        self._group.leave()


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise FaultError(f"no process {pid}") from None
    except PermissionError:
        raise FaultError(f"not allowed to signal process {pid}") from None


@dataclass(slots=True)
class Kill:
    """SIGKILL process `pid`; there is nothing to undo."""

    pid: int

    def apply(self) -> None:
        _signal(self.pid, signal.SIGKILL)

    def undo(self) -> None:
        return None


def _tc(netns: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    try:
        return subprocess.run([*prefix, "tc", *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise FaultError("the `tc` tool (iproute2) is not installed") from None


@dataclass(frozen=True, slots=True)
class Interface:
    """A network interface, in a namespace or (netns None) in the current one."""

    dev: str
    netns: str | None = None


@dataclass(slots=True)
class RateLimit:
    """Hold what each of `interfaces` sends to `mbit` Mbit/s with a token bucket (tbf)."""

    interfaces: Sequence[Interface]
    mbit: float

    def __post_init__(self) -> None:
        if not 0.01 <= self.mbit <= 100_000:
            raise ValueError("a rate between 0.01 and 100000 Mbit/s")

    def apply(self) -> None:
        rate = f"{int(self.mbit * 1000)}kbit"
        # a bucket of ~10 ms at the rate, at least two full frames; packets wait at most 1 s
        burst = max(int(self.mbit * 1e6 / 8 / 100), 3200)
        for i in self.interfaces:
            out = _tc(i.netns, "qdisc", "replace", "dev", i.dev, "root", "tbf", "rate", rate,
                      "burst", str(burst), "latency", "1s")
            if out.returncode != 0:
                self.undo()
                raise FaultError(f"tc on {i.dev}: {out.stderr.strip()}")

    def undo(self) -> None:
        for i in self.interfaces:
            _tc(i.netns, "qdisc", "del", "dev", i.dev, "root")  # absent already: harmless


@dataclass(slots=True)
class Flapping:
    """`limit` on for `on_s`, off for `off_s`, again and again until undone."""

    limit: RateLimit
    on_s: float
    off_s: float
    _stop: threading.Event = field(init=False, default_factory=threading.Event)
    _thread: threading.Thread | None = field(init=False, default=None)

    def apply(self) -> None:
        self.limit.apply()  # fails here, loudly, if tc cannot shape the interface
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="flare-flap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        on = True
        while not self._stop.wait(self.on_s if on else self.off_s):
            on = not on
            with contextlib.suppress(FaultError):
                self.limit.apply() if on else self.limit.undo()

    def undo(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self.limit.undo()


@dataclass(slots=True)
class GpuClockLock:
    """Lock GPU `index`'s graphics clock to `mhz` (min = max) until undone."""

    index: int
    mhz: int
    tool: str = "nvidia-smi"

    def __post_init__(self) -> None:
        if self.index < 0 or not 100 <= self.mhz <= 5000:
            raise ValueError("a GPU index >= 0 and a clock between 100 and 5000 MHz")

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        exe = shutil.which(self.tool)
        if exe is None:
            raise FaultError(f"no `{self.tool}` on this node: a GPU clock lock needs the "
                             "NVIDIA driver")
        return subprocess.run([exe, "-i", str(self.index), *args], capture_output=True,
                              text=True)

    def apply(self) -> None:
        out = self._run("-lgc", f"{self.mhz},{self.mhz}")
        if out.returncode != 0:
            self.undo()  # whatever it did set before failing, nothing stays locked
            said = (out.stderr or out.stdout).strip().splitlines()
            raise FaultError(f"{self.tool} could not lock GPU {self.index}'s clock: "
                             f"{said[-1] if said else f'exit {out.returncode}'}")

    def undo(self) -> None:
        with contextlib.suppress(FaultError):
            self._run("-rgc")  # resetting an unlocked clock is harmless
