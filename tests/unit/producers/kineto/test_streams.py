"""Groups of older NCCL traces told from their CUDA streams (`producers.kineto.streams`)."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import orjson

from flare.offline import diagnose_messages
from producers.kineto.groups import ProcessGroup, ThreadOps
from producers.kineto.replay import kineto_to_events
from producers.kineto.streams import assign_streams
from producers.simulator import ClusterSimulator
from producers.simulator.scenario import Fault, Scenario, layout_for_gpus
from tests.unit.producers.kineto.conftest import older_nccl_traces

MS = 1_000_000
_NODES = {r: f"node-{r // 2}" for r in range(8)}


def _lanes(ends: np.ndarray, durs: np.ndarray | int = MS) -> dict[tuple[int, str], ThreadOps]:
    """One lane per rank (row of `ends`), one all-reduce per step."""
    steps = np.arange(ends.shape[1])
    durs = np.broadcast_to(durs, ends.shape)
    return {(r, "20"): ThreadOps.of(["all_reduce"] * steps.size, row, d, steps)
            for r, (row, d) in enumerate(zip(ends, durs, strict=True))}


def test_lone_members_of_groups_in_lockstep_stay_alone():
    """Four DP groups, one traced member each, run their all-reduces in lockstep: each ends
    as apart from the others as it started (0.3 ms of jitter on 1 ms ops): no group."""
    rng = np.random.default_rng(0)
    ends = np.arange(20) * 100 * MS + rng.integers(0, 300_000, size=(4, 20))
    assert assign_streams(_lanes(ends), {}, _NODES) == {}


def test_a_world_group_spread_over_nodes_is_one_group():
    """The members arrive up to 0.5 ms apart and end within a few µs of a hop on another
    node, to the µs on their own: one group, whatever each node's clock offset."""
    rng = np.random.default_rng(1)
    base = np.arange(20) * 100 * MS
    offset = np.repeat([0, 3_000_000, -7_000_000, 11_000_000], 2)[:, None]
    hop = np.repeat(rng.integers(0, 8_000, size=(4, 20)), 2, axis=0)  # per node
    waited = MS + rng.integers(0, 500_000, size=(8, 20))  # arrived early, waited longer
    found = assign_streams(_lanes(base + offset + hop, waited), {}, _NODES)
    assert {g.ranks for g in found.values()} == {tuple(range(8))}


def test_a_rank_never_has_two_lanes_in_one_group():
    """Two streams of rank 0 run the same ops at the same times as rank 1's one: rank 1
    joins one of them, never both."""
    steps = np.arange(10)
    ends = steps * 100 * MS
    lanes = {(0, "20"): ThreadOps.of(["all_reduce"] * 10, ends, MS, steps),
             (0, "24"): ThreadOps.of(["all_reduce"] * 10, ends + 2_000, MS, steps),
             (1, "20"): ThreadOps.of(["all_reduce"] * 10, ends + 1_000, MS, steps)}
    found = assign_streams(lanes, {}, _NODES)
    assert sorted(k for k in found) in ([(0, "20"), (1, "20")], [(0, "24"), (1, "20")])
    assert {g.ranks for g in found.values()} == {(0, 1)}


def test_a_group_that_pg_config_lists_keeps_its_name():
    ends = np.arange(10) * 100 * MS + np.zeros((2, 1), dtype=np.int64)
    dp = ProcessGroup("7", "mesh_dp", (0, 1))
    found = assign_streams(_lanes(ends), {0: (dp,), 1: (dp,)}, _NODES)
    assert set(found.values()) == {dp}


def _job(tmp_path: Path, fault: Fault | None) -> tuple[list[dict], Path]:
    """A simulated 32-GPU job (TP4, PP2, DP4) and its older-NCCL traces in `tmp_path`."""
    sc = Scenario(job="j", layout=layout_for_gpus(32), steps=30, seed=2, heartbeats=False,
                  fault=fault)
    msgs = [v for _t, _k, v, _ts in ClusterSimulator(sc).events() if "ops" in v]
    for name, doc in older_nccl_traces(msgs, seed=2).items():
        (tmp_path / name).write_bytes(orjson.dumps(doc))
    return msgs, tmp_path


def test_older_nccl_traces_get_the_groups_the_job_ran(tmp_path):
    """Every group of the job, collectives and pipeline pairs, comes back with its members,
    and a pair's sends and receives are named by their direction on both ends."""
    msgs, folder = _job(tmp_path, None)
    truth: dict[str, set[int]] = defaultdict(set)
    for m in msgs:
        for g in m["ops"]["group"]:
            if g:
                truth[g].add(m["rank"])
    found: dict[str, set[int]] = defaultdict(set)
    directions: dict[str, set[tuple[int, str]]] = defaultdict(set)
    for _t, _k, v, _ts in kineto_to_events([folder], "j"):
        for k, n, g in zip(*(v.get("ops", {}).get(c, ()) for c in ("kind", "name", "group")),
                           strict=True):
            if k == "p2p":
                directions[g].add((v["rank"], n))
                g = g.rsplit(".", 1)[0]
            if g:
                found[g].add(v["rank"])
    assert sorted(map(sorted, found.values())) == sorted(map(sorted, truth.values()))
    for g, seen in directions.items():
        src, dst = map(int, g.rsplit(".", 1)[1].split("-"))
        assert seen == {(src, "send"), (dst, "recv")}


def test_a_nic_is_named_from_older_nccl_traces(tmp_path):
    """A NIC slowed ×1.5 from step 12 shows only in transfers: named from the traces as from
    the simulator's own stream (before the streams were read, the replay named nothing)."""
    fault = Fault("nic", 1.5, 12, target="node:node-0001")
    _msgs, folder = _job(tmp_path, fault)
    events = kineto_to_events([folder], "j")
    found = diagnose_messages((t, orjson.dumps(v)) for t, _k, v, _ts in events).incidents
    assert [(i.kind, i.culprit) for i in found.values()] == [("link", "node:node-0001")]


def test_a_clean_half_traced_job_from_older_nccl_traces_opens_nothing(tmp_path):
    """A random half of a 64-GPU job's ranks traced (rank 0 among them): a third of the
    streams have no traced partner and stay their rank's own; nothing opens (stages were
    once told apart by their compute mix alone, one `gpu_compute` op on every stage, and
    three hosts opened)."""
    sc = Scenario(job="j", layout=layout_for_gpus(64), steps=40, seed=3, heartbeats=False)
    traced = set(random.Random(3).sample(range(64), 32)) | {0}
    msgs = [v for _t, _k, v, _ts in ClusterSimulator(sc).events()
            if "ops" in v and v["rank"] in traced]
    for name, doc in older_nccl_traces(msgs, seed=3).items():
        (tmp_path / name).write_bytes(orjson.dumps(doc))
    events = kineto_to_events([tmp_path], "j")
    found = diagnose_messages((t, orjson.dumps(v)) for t, _k, v, _ts in events).incidents
    assert not found
