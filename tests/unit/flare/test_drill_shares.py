"""A drill with fixed CPU shares: each rank in a `cpu` cgroup of its own with a quota, the
slowed rank's fault inside its share, everything removed after; refused without root.

The shares exist so that a rank computes at one rate whether or not its peers wait (on a
drill's few shared cores it otherwise computes faster while they do), which is what makes a
drill's measured slowdown that of a GPU job (`flare.drill.cost`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import flare.drill.run as drill_run
from flare.cli import app
from flare.drill.faults import CFS_PERIOD_US, CGROUP_ROOT
from flare.drill.run import (
    DrillError,
    DrillSpec,
    cpu_shares,
    rank_share,
    run_drill,
    slow_rank_quota,
)

CPU = CGROUP_ROOT / "cpu"


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)


def _fake_cpu_controller(root: Path) -> Path:
    """A cgroup v1 `cpu` controller as files: enough for the quotas to be written and read."""
    base = root / "cpu"
    base.mkdir()
    (base / "cgroup.procs").write_text("")
    return base


def _quota(group: Path) -> int:
    return int((group / "cpu.cfs_quota_us").read_text())


def _rate(group: Path) -> tuple[int, int]:
    """(quota, period) in µs."""
    return _quota(group), int((group / "cpu.cfs_period_us").read_text())


def _procs(group: Path) -> list[int]:
    return [int(x) for x in (group / "cgroup.procs").read_text().split()]


def test_the_ranks_together_leave_a_fifth_of_the_cores_to_the_broker_and_agents() -> None:
    assert rank_share(8, 2) == pytest.approx(0.2)
    assert rank_share(8, 16) == pytest.approx(1.6)
    assert 8 * rank_share(8, 2) < 2


@pytest.mark.usefixtures("two_cores")
def test_without_the_option_there_are_no_shares_and_the_fault_is_as_before(
        tmp_path: Path) -> None:
    base = _fake_cpu_controller(tmp_path)
    spec = DrillSpec(fault="slow-rank", tag="t")
    assert spec.share is None and cpu_shares(spec, [11, 12]) == []
    slow_rank_quota(spec, 3, 11, root=tmp_path).apply()
    assert _rate(base / "flare-t-3") == (int(0.1 * CFS_PERIOD_US), CFS_PERIOD_US)


@pytest.mark.usefixtures("two_cores")
def test_each_rank_gets_its_own_quota_and_the_slowed_rank_a_lower_one_inside_it(
        tmp_path: Path) -> None:
    base = _fake_cpu_controller(tmp_path)
    spec = DrillSpec(fault="slow-rank", cpus=0.1, tag="t", cpu_share=True)
    shares = cpu_shares(spec, [101, 102, 103], root=tmp_path)
    for q in shares:
        q.apply()
    groups = [base / f"flare-t-{r}-share" for r in range(3)]
    # 0.2 CPU as 1 ms every 5 ms: a rate, not a budget a rank that waited spends at once
    assert [_rate(g) for g in groups] == [(1_000, 5_000)] * 3
    assert [_procs(g) for g in groups] == [[101], [102], [103]]

    fault = slow_rank_quota(spec, 1, 102, root=tmp_path)
    fault.apply()
    assert _rate(groups[1] / "fault") == (1_000, 10_000)
    assert _procs(groups[1] / "fault") == [102]
    fault.undo()  # the rank goes back to its share, not to the machine's root group
    assert _procs(groups[1]) == [102] and _procs(base) == []

    for q in shares:
        q.undo()
    assert [_quota(g) for g in groups] == [-1] * 3
    assert _procs(base) == [103]  # the fake controller keeps the last pid moved back


@pytest.mark.usefixtures("two_cores")
def test_a_slowed_rank_quota_at_or_above_its_share_is_refused() -> None:
    with pytest.raises(ValueError, match="below each rank's share, 0.2 CPUs"):
        DrillSpec(fault="slow-rank", cpus=0.2, cpu_share=True)
    assert DrillSpec(fault="slow-rank", cpus=0.2).share is None  # no shares, no limit
    assert DrillSpec(fault="nic", cpus=0.5, cpu_share=True).share == pytest.approx(0.2)


@pytest.mark.skipif(os.geteuid() != 0 or not (CPU / "cgroup.procs").exists(),
                    reason="cgroup v1 cpu needs root and the controller")
@pytest.mark.usefixtures("two_cores")
def test_real_shares_and_a_nested_fault_are_accepted_by_the_kernel_and_leave_nothing(
        ) -> None:
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
                for _ in range(2)]
    spec = DrillSpec(fault="slow-rank", cpus=0.1, tag=f"tshare{os.getpid()}", cpu_share=True)
    shares = cpu_shares(spec, [c.pid for c in children])
    fault = slow_rank_quota(spec, 1, children[1].pid)
    groups = [CPU / f"flare-{spec.tag}-{r}-share" for r in range(2)]
    try:
        for q in shares:
            q.apply()
        fault.apply()
        assert [_rate(g) for g in groups] == [(1_000, 5_000)] * 2
        assert _rate(groups[1] / "fault") == (1_000, 10_000)
        assert _procs(groups[1] / "fault") == [children[1].pid]
        fault.undo()
        assert _procs(groups[1]) == [children[1].pid]
    finally:
        fault.undo()
        for q in shares:
            q.undo()
        for c in children:
            c.kill()
            c.wait()
    assert not any(g.exists() for g in groups)


@pytest.fixture
def rootless(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not root, and a drill that gets as far as building its hosts fails at once: a
    refusal that regressed must not start a real (loopback) drill from a unit test."""
    def must_not_start(*_: object) -> None:
        raise AssertionError("the drill started")

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(drill_run, "_hosts", must_not_start)


@pytest.mark.usefixtures("rootless")
def test_a_rootless_drill_refuses_shares_before_it_starts_anything(tmp_path: Path) -> None:
    with pytest.raises(DrillError, match="CPU shares need root"):
        run_drill(DrillSpec(cpu_share=True, workdir=tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("rootless")
def test_the_cli_refuses_shares_without_root_in_one_line(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["drill", "--cpu-share", "--workdir", str(tmp_path)])
    assert out.exit_code == 2
    assert out.output.strip().splitlines() == [
        "error: fixed CPU shares need root (each rank gets a cgroup of its own); drill "
        "without them"]


@pytest.mark.parametrize(("args", "shared"), [(["--cpu-share"], True), ([], False)])
def test_the_cli_option_reaches_the_spec(args: list[str], shared: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[DrillSpec] = []

    def stop(spec: DrillSpec, say: object) -> None:
        seen.append(spec)
        raise DrillError("stopped here")

    monkeypatch.setattr(drill_run, "run_drill", stop)
    out = CliRunner().invoke(app, ["drill", "--fault", "nic", *args])
    assert out.exit_code == 2 and out.output.strip() == "error: stopped here"
    assert [s.cpu_share for s in seen] == [shared]
