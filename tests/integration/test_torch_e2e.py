"""End to end, for real: gloo training with the hook → node daemon → tansu → worker → chDB → API.

Four CPU ranks train a tiny transformer (DDP over the world plus tagged tp/dp subgroups and
p2p, `tests.integration.test_torch_gloo.train`) with the Flare hook on; the node daemon ships their
steps and heartbeats to the session's tansu broker; a `flare worker` (embedded chDB, API in
the same process) diagnoses the job; the test asks the API, as an operator would:
- one rank slowed by extra compute in its forward → a `gpu` incident on that rank;
- one rank that stops inside training → a `hang` incident on that rank, within 30 s;
- all ranks healthy → once every step is stored, no device or hang incident.

Only the tests' own knobs are chosen here (steps, slowdown, where the stop happens); the
worker runs with its default detector settings. The ranks start first and the worker while
they import torch (the slowest part of a run on a 2-core machine): the worker reads the
topics from the beginning, so it misses nothing, and any delay is on the detection side.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flare.local.broker import TansuBroker
from tests.integration.conftest import WorkerProcess, unique, wait_for

pytest.importorskip("torch")

from tests.integration.torch_e2e_support import (  # noqa: E402 (imports torch)
    WORLD,
    KafkaAgent,
    launch_ranks,
    run_to_end,
    stop_all,
)

pytestmark = [pytest.mark.integration, pytest.mark.torch, pytest.mark.timed]

DEVICE_KINDS = {"gpu", "node", "host", "link", "switch", "hang"}
HEARTBEAT_S = 0.2  # the daemon's heartbeat period and the ranks' in-flight table period
HANG_DEADLINE_S = 30.0  # the bound, from the stop to the incident in the API

StartWorker = Callable[..., WorkerProcess]

@pytest.fixture
def sock() -> Iterator[Path]:
    # Short on purpose: a Unix socket path is limited to ~107 bytes, pytest's tmp_path is long.
    d = Path(tempfile.mkdtemp(prefix="flare-e2e-", dir="/tmp"))
    yield d / "agent.sock"
    shutil.rmtree(d, ignore_errors=True)


def incidents(worker: WorkerProcess, job: str) -> list[dict[str, Any]]:
    r = worker.get("/v1/incidents", job=job, limit=1000)
    assert r.status_code == 200, r.text
    return r.json()["items"]


def brief(items: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What to show of incidents in a failure: kind, culprit, status, onset, opened, last
    and resolved step."""
    return [(i["kind"], i["culprit"], i["status"], i["onset_step"], i["opened_step"],
             i["last_step"], i["resolved_step"]) for i in items]


def describe(worker: WorkerProcess, job: str) -> str:
    """The worker's view of the job, for failure messages: incidents, their culprits'
    per-step detections, and per-rank scores."""
    found = incidents(worker, job)
    parts = [f"incidents: {brief(found)}"]
    for inc in found:
        r = worker.get(f"/v1/incidents/{inc['id']}")
        if r.status_code == 200:
            seen = [(d["step"], round(d["score"], 1)) for d in
                    r.json()["evidence"]["culprit_detections"]]
            parts.append(f"{inc['culprit']} ({inc['kind']}) detected at (step, score): {seen}")
    for path in (f"/v1/jobs/{job}", f"/v1/jobs/{job}/ranks"):
        r = worker.get(path)
        parts.append(f"{path}: {r.status_code} {r.text[:2000]}")
    return "\n".join(parts)


def wait_until_settled(worker: WorkerProcess, job: str, steps: int) -> None:
    """Every step of the job is stored and the worker has nothing left to read or hold.

    /worker/stats runs on the worker's loop, between batches: once it reports no lag, the
    batch that stored the last step (and the incidents it produced, same flush) is done.
    """
    def stored() -> bool:
        r = worker.get(f"/v1/jobs/{job}")
        return r.status_code == 200 and r.json()["steps"] == steps \
            and r.json()["last_step"] == steps - 1

    def idle() -> bool:
        s = worker.stats()
        return s["total_lag"] == 0 and s["held_for_order"] == 0 and s["acked"] == s["processed"]

    wait_for(stored, 60, f"the worker to store the {steps} steps of {job}")
    wait_for(idle, 30, "the worker to have nothing left to read")


def test_a_slowed_rank_is_named_as_the_gpu_culprit(
        broker: TansuBroker, start_worker: StartWorker, sock: Path) -> None:
    job, steps, slow = unique("torch-slow"), 20, 2
    with KafkaAgent(broker.connection, sock, "node-test", HEARTBEAT_S) as agent:
        procs = launch_ranks(sock, job, steps, slow_rank=slow, slow_s=0.15)
        try:
            worker = start_worker(unique("g-torch-slow"))
        finally:
            run_to_end(procs)
    assert agent.delivered()
    wait_until_settled(worker, job, steps)

    found = incidents(worker, job)
    gpu = [i for i in found if i["kind"] == "gpu" and i["culprit"] == f"rank:{slow}"]
    assert len(gpu) == 1, describe(worker, job)
    inc = gpu[0]
    print(f"\ngpu incident opened at step {inc['opened_step']} of {steps}: {inc['summary']}")
    assert inc["suspects"][0]["entity"] == f"rank:{slow}"
    assert inc["evidence_steps"] >= 3 and inc["slowdown"] > 1.0, inc
    assert inc["opened_step"] < steps - 1, inc  # confirmed while training, not at the end
    others = [i for i in found if i["kind"] in DEVICE_KINDS and i["id"] != inc["id"]]
    assert not others, brief(others)


def test_a_rank_that_stops_is_named_in_a_hang_incident_within_30_s(
        broker: TansuBroker, start_worker: StartWorker, sock: Path) -> None:
    job, stuck, stop_step = unique("torch-hang"), 1, 8
    with KafkaAgent(broker.connection, sock, "node-test", HEARTBEAT_S) as agent:
        procs = launch_ranks(sock, job, 1000, stop_rank=stuck, stop_step=stop_step)
        try:
            worker = start_worker(unique("g-torch-hang"))
            # The rank stops right after shipping step stop_step - 1: that step's end is
            # the moment of the stop (same clock as the heartbeats: one machine).
            wait_for(lambda: (s := agent.tap.newest_step(stuck)) is not None
                     and s.step == stop_step - 1, 90, f"rank {stuck} to reach its stop")
            stopped_ns = agent.tap.newest_step(stuck).t_end_ns  # type: ignore[union-attr]

            def hang() -> dict[str, Any] | None:
                return next((i for i in incidents(worker, job) if i["kind"] == "hang"), None)

            deadline_s = HANG_DEADLINE_S - (time.time_ns() - stopped_ns) / 1e9
            wait_for(lambda: hang() is not None, deadline_s, "a hang incident in the API")
            seen_ns = time.time_ns()
            inc = hang()
            assert inc is not None
            assert all(p.poll() is None for p in procs), "the ranks must still be stuck"
        finally:
            stop_all(procs)
    latency_s = (seen_ns - stopped_ns) / 1e9
    opened_s = (inc["opened_ts_ns"] - stopped_ns) / 1e9
    print(f"\nhang of rank {stuck}: opened {opened_s:.1f} s after the stop (stream time), "
          f"in the API {latency_s:.1f} s after it")
    assert 0 < opened_s <= latency_s <= HANG_DEADLINE_S
    assert inc["culprit"] == f"rank:{stuck}", inc
    assert inc["suspects"][0]["entity"] == f"rank:{stuck}", inc
    assert inc["onset_step"] == stop_step and inc["status"] == "open", inc
    assert f"rank {stuck} " in inc["summary"] and f"{WORLD - 1} ranks are blocked" \
        in inc["summary"], inc["summary"]
    others = [i for i in incidents(worker, job)
              if i["kind"] in DEVICE_KINDS and i["id"] != inc["id"]]
    assert not others, brief(others)


def test_a_healthy_run_has_no_device_incident(
        broker: TansuBroker, start_worker: StartWorker, sock: Path) -> None:
    job, steps = unique("torch-ok"), 40
    with KafkaAgent(broker.connection, sock, "node-test", HEARTBEAT_S) as agent:
        procs = launch_ranks(sock, job, steps)
        try:
            worker = start_worker(unique("g-torch-ok"))
        finally:
            run_to_end(procs)
    assert agent.delivered()
    wait_until_settled(worker, job, steps)

    health = worker.get(f"/v1/jobs/{job}").json()
    assert health["n_ranks"] == WORLD, health
    bad = [i for i in incidents(worker, job) if i["kind"] in DEVICE_KINDS]
    assert not bad, describe(worker, job)
