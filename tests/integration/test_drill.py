"""`flare drill`: real gloo training on network namespaces, one real fault, Flare's verdict.

Each drill builds its own hosts (network namespaces on a bridge), runs 8 ranks of a small
tensor-, pipeline- and data-parallel transformer on 4 of them through the hook and one agent
per node, publishing to a tansu broker in the run's hub namespace over the node's NIC,
injects the fault with the kernel's own mechanisms (a cgroup CPU quota, a tbf rate limit on
the node's NIC, the cgroup freezer, SIGKILL) and diagnoses what the broker received with the
worker's detectors. Four run in the slow tier (`pytest -m slow`), the first three's
recordings' diagnosis in the default run (`test_drill_recordings.py`): a killed rank, a
flapping NIC, a drill that traces one rank per node only (`--traced tp0`), with the fault on
a rank that is not traced, and a clean drill. Namespaces, cgroups and qdiscs need root;
without it the tests skip.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from flare.cli import app
from flare.drill.run import DrillSpec, run_drill

pytest.importorskip("torch")
pytestmark = [
    pytest.mark.torch,
    pytest.mark.timed,
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces, cgroups and tc need root"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None,
                       reason="iproute2 (ip, tc) is not installed"),
]

# fewer steps than the command's defaults: the suite runs on 2 shared cores. 15 steps
# before the fault are a baseline (live on a loaded machine, 2026-11-28: slow-rank, NIC,
# freeze, kill and flapping drills of 3 seeds each passed with 15, latencies -1 to 3)
SHORT = {"steps_before": 15, "steps_after": 15}


# a slowed rank is named within 3 steps (ACCURACY.md): 8 steps are enough (and each of them
# is long: the rank has a tenth of a core); a held NIC in the step it starts or the one
# before: 5 steps (each ×7)
# in the slow tier (the default run sits near CI's 20-minute budget; the recordings of both
# are diagnosed in the default run, test_drill_recordings.py):
# - a killed rank (a stopped rank's hang is also named live in test_torch_e2e.py, and a
#   killed rank's recordings are diagnosed in the default run);
# - a flapping NIC, at its first or second burst (10 of 10 live, latency 12 steps at most);
#   its bursts come every 6 steps or so, and 30 steps give it five: on a machine slowed by
#   other work, 20 steps once showed only a job-wide shift (CI, 2026-11-28);
# - one rank per node traced (as production tracers often record), and the killed rank is
#   not one of them: its node is named, from the layout the traced ranks' hook sent
@pytest.mark.parametrize(("fault", "seed", "after", "traced"), [
    ("slow-rank", 1, 8, "all"),
    ("nic", 1, 5, "all"),
    ("freeze", 2, 20, "all"),
    pytest.param("kill", 3, 20, "all", marks=pytest.mark.slow),
    pytest.param("flapping-nic", 200, 30, "all", marks=pytest.mark.slow),
    pytest.param("kill", 101, 20, "tp0", marks=pytest.mark.slow),
])
def test_a_real_fault_is_named_with_its_culprit_and_kind(tmp_path: Path, fault: str, seed: int,
                                                         after: int, traced: str) -> None:
    res = run_drill(DrillSpec(fault=fault, seed=seed, workdir=tmp_path, tag=f"t{seed}{fault[0]}",
                              steps_before=SHORT["steps_before"], steps_after=after,
                              traced=traced))
    found = res.found
    assert found is not None, f"{fault}: nothing opened after the fault; {res.incidents}"
    expected = res.truth.culprit if traced == "all" else f"node:{res.truth.untraced_node}"
    assert (found.kind, found.culprit) == (res.truth.kind, expected), found.summary
    assert not res.false_device, [(i.kind, i.culprit, i.summary) for i in res.false_device]
    assert res.passed
    # every message an agent sent crossed its node's NIC to the broker, the faulty one too
    assert res.sent > 0 and res.received == res.sent
    if fault == "freeze":  # hang forensics: the frozen rank as its node saw it, the others'
        stacks = [i.stacks for i in res.incidents if i.id == found.id and i.stacks]
        assert stacks, "the hang incident carries no stacks"
        groups = stacks[-1]
        rank = found.culprit.removeprefix("rank:")
        # (the agent runs under `ip netns exec`, which hides the cgroup file system: it sees
        # the frozen rank in uninterruptible sleep) and reads where it stopped from outside
        # it, in the training script
        assert any(g.ranks == rank and "read from outside" in g.note
                   and any(f.startswith("train.py:") for f in g.frames)
                   for g in groups), groups
        # its peers wait in the backward pass or a collective (the frozen rank itself may
        # have stopped anywhere in its step)
        waiting = [g for g in groups if g.thread == "training" and g.frames
                   and g.ranks != rank]
        assert waiting and all(any(" in backward" in f or "distributed_c10d.py" in f
                                   for f in g.frames) for g in waiting), waiting


# slow tier: every drill above asserts no false device incident over its 15 steps before the
# fault too, and a healthy run through the hook and the worker is test_torch_e2e's
@pytest.mark.slow
def test_a_clean_drill_opens_no_device_incident_and_says_so_as_json(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, [
        "drill", "--fault", "none", "--json", "--workdir", str(tmp_path),
        "--steps-before", str(SHORT["steps_before"]), "--steps-after", str(SHORT["steps_after"]),
    ])
    assert out.exit_code == 0, out.output
    verdict = orjson.loads(out.stdout)
    assert verdict["passed"] is True and verdict["truth"]["culprit"] is None
    assert [i for i in verdict["incidents"] if i["kind"] != "job"] == []
    assert verdict["steps"] >= SHORT["steps_before"] + SHORT["steps_after"]
    assert 0 < verdict["step_s"] < 30  # the job's own step time, which the drill's waits scale by
    assert verdict["messages_received"] == verdict["messages_sent"] > 0


def test_a_drill_refuses_what_it_cannot_run() -> None:
    out = CliRunner().invoke(app, ["drill", "--fault", "meteor"])
    assert out.exit_code == 2 and "unknown fault" in out.output
    out = CliRunner().invoke(app, ["drill", "--ranks", "6", "--nodes", "4"])
    assert out.exit_code == 2 and "spread evenly" in out.output
