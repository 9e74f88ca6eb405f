"""`flare chaos`: it refuses to guess a target, and a real fault is applied, then undone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flare.cli import app

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


def run(*args: str):
    return CliRunner().invoke(app, ["chaos", *args])


@pytest.mark.parametrize(("args", "says"), [
    (["--duration", "1"], "exactly one target"),
    (["--duration", "1", "--freeze", "1", "--cpu-quota", "1"], "exactly one target"),
    (["--duration", "0", "--freeze", "1"], "--duration must be > 0"),
    (["--duration", "1", "--cpu-quota", "1", "--cpus", "0"], "cpus is a share"),
])
def test_it_refuses_without_one_clear_target(args: list[str], says: str) -> None:
    out = run(*args)
    assert out.exit_code == 2 and says in out.output
    assert len(out.output.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() != 0 or not (CPU_CGROUP / "cgroup.procs").exists(),
                    reason="cgroup v1 cpu needs root and the controller")
def test_a_cpu_quota_is_applied_then_undone_and_a_missing_process_is_one_line() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        out = run("--cpu-quota", str(child.pid), "--cpus", "0.2", "--duration", "0.3")
        assert out.exit_code == 0, out.output
        assert f"applied: CPU quota 0.2 on process {child.pid}" in out.output
        assert "undone:" in out.output
        assert not (CPU_CGROUP / f"flare-chaos-{child.pid}").exists()  # nothing left behind
        assert str(child.pid) in (CPU_CGROUP / "cgroup.procs").read_text().split()
    finally:
        child.kill()
        child.wait()
    out = run("--cpu-quota", str(child.pid), "--duration", "0.3")  # it is gone now
    assert out.exit_code == 2 and out.output.startswith("error:")
    assert not (CPU_CGROUP / f"flare-chaos-{child.pid}").exists()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                    reason="namespaces and tc need root and iproute2")
def test_a_rate_limit_is_on_while_it_lasts_and_gone_after() -> None:
    ns = f"flare-tchaos-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "d0", "type", "veth", "peer", "name", "d1"],
                       check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "d0", "up"], check=True)
        seen: list[str] = []
        probe = subprocess.Popen(  # what tc shows while the fault is on
            ["sh", "-c", f"sleep 1; ip netns exec {ns} tc qdisc show dev d0"],
            stdout=subprocess.PIPE, text=True)
        out = run("--rate-limit", "d0", "--netns", ns, "--mbit", "5", "--duration", "3")
        seen.append(probe.communicate(timeout=10)[0])
        assert out.exit_code == 0, out.output
        assert "applied: 5 Mbit/s on d0" in out.output and "undone:" in out.output
        assert "tbf" in seen[0]
        after = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "d0"],
                               capture_output=True, text=True).stdout
        assert "tbf" not in after
    finally:
        subprocess.run(["ip", "netns", "delete", ns])


def _fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exit_code: int = 0) -> Path:
    """A stand-in `nvidia-smi` first on PATH (no GPU here): it logs its arguments, and fails
    with `exit_code` when asked to lock, as the driver does for a GPU that refuses."""
    calls = tmp_path / "calls"
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                    f'case "$3" in -lgc) echo "Setting locked GPU clocks is not supported" >&2;'
                    f' exit {exit_code};; esac\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_a_gpu_clock_is_locked_then_reset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_nvidia_smi(tmp_path, monkeypatch)
    out = run("--gpu-clock", "3", "--mhz", "700", "--duration", "0.2")
    assert out.exit_code == 0, out.output
    assert "applied: clock of GPU 3 locked to 700 MHz" in out.output and "undone:" in out.output
    assert calls.read_text().splitlines() == ["-i 3 -lgc 700,700", "-i 3 -rgc"]


def test_a_gpu_that_refuses_the_lock_is_one_line_and_left_reset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_nvidia_smi(tmp_path, monkeypatch, exit_code=3)
    out = run("--gpu-clock", "0", "--duration", "0.2")
    assert out.exit_code == 2
    assert out.output.strip() == ("error: nvidia-smi could not lock GPU 0's clock: Setting "
                                  "locked GPU clocks is not supported")
    assert calls.read_text().splitlines() == ["-i 0 -lgc 600,600", "-i 0 -rgc"]


def test_without_the_driver_a_gpu_clock_lock_says_so(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    out = run("--gpu-clock", "0", "--duration", "0.2")
    assert out.exit_code == 2 and "needs the NVIDIA driver" in out.output
    assert len(out.output.strip().splitlines()) == 1
