"""Kineto replay of traces that torch.profiler writes during a real gloo run (2 processes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import orjson
import pytest

from producers.kineto.replay import kineto_to_events
from schemas.decode import decode_job, decode_steps
from schemas.rankstep import KIND_CODE

pytestmark = [pytest.mark.torch, pytest.mark.timed]  # a slowed rank's forward, its peers' wait

REPO = Path(__file__).resolve().parents[2]


def profiled_train(rank: int, world: int, port: int, out: str, slow_rank: int) -> None:
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    sched = torch.profiler.schedule(wait=1, warmup=1, active=4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                schedule=sched, record_shapes=True,
                                on_trace_ready=torch.profiler.tensorboard_trace_handler(out)) as p:
        for _ in range(6):
            if rank == slow_rank:
                end = time.perf_counter() + 0.05
                while time.perf_counter() < end:
                    torch.tanh(torch.randn(64, 64) @ torch.randn(64, 64))
            loss = model(x).pow(2).mean()
            loss.backward()
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
            opt.step()
            opt.zero_grad()
            p.step()
    dist.destroy_process_group()


def run_ranks(train: str, world: int, out: Path, slow_rank: int) -> None:
    """`train(rank, world, port, out, slow_rank)` of this module in `world` processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen(
        [sys.executable, "-c", f"from tests.integration.test_kineto_gloo import {train}; "
                               f"{train}({r}, {world}, {port}, {str(out)!r}, {slow_rank})"],
        cwd=REPO, env=env) for r in range(world)]
    try:
        for p in procs:
            assert p.wait(180) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_traces_of_a_real_gloo_run(tmp_path):
    pytest.importorskip("torch")
    run_ranks("profiled_train", 2, tmp_path, slow_rank=1)
    events = list(kineto_to_events([tmp_path], "gloo-kineto"))
    assert decode_job(orjson.dumps(events[0][2])).world_size == 2
    by_rank = defaultdict(list)
    for _t, _k, v, _ts in events[1:]:
        m = decode_steps(orjson.dumps(v))
        by_rank[m.rank].append(m)
    assert sorted(by_rank) == [0, 1]
    for ms in by_rank.values():
        assert len(ms) == 4
        for m in ms:
            assert m.name.count("all_reduce") == 4
            assert {"fwd", "bwd", "optimizer"} <= set(m.name)
    # The same collective instance has the same (group, seq) on both ranks.
    keys = [{(g, int(q)) for m in by_rank[r]
             for g, q, k in zip(m.group, m.seq, m.kind, strict=True) if k} for r in (0, 1)]
    assert keys[0] == keys[1] and len(keys[0]) == 16

    def fwd(r):
        return np.median([m.dur_ns[m.name.index("fwd")] for m in by_rank[r]])

    def waited(r):
        return np.median([m.dur_ns[m.kind == 1].sum() for m in by_rank[r]])

    assert fwd(1) > 0.04e9 > fwd(0)  # rank 1's forward is slowed by 50 ms
    assert waited(0) > waited(1) + 0.02e9  # rank 0 waits for it in the all-reduces


def profiled_groups_train(rank: int, world: int, port: int, out: str, slow_rank: int) -> None:
    """4 ranks: tensor-parallel pairs {0,1} {2,3} all-reduce in the forward, data-parallel
    pairs {0,2} {1,3} reduce gradients, everyone all-reduces the loss, and pipeline pairs
    (groups of their own, on the data-parallel pairs' ranks) send and receive."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    tp = {n: dist.new_group([2 * n, 2 * n + 1]) for n in range(2)}[rank // 2]
    dp = {t: dist.new_group([t, t + 2]) for t in range(2)}[rank % 2]
    pp = {t: dist.new_group([t, t + 2]) for t in range(2)}[rank % 2]
    peer = rank + 2 if rank < 2 else rank - 2
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
    x = torch.randn(32, 64)
    sched = torch.profiler.schedule(wait=1, warmup=1, active=6)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                schedule=sched,
                                on_trace_ready=torch.profiler.tensorboard_trace_handler(out)) as p:
        for _ in range(8):
            h = x
            for layer in layers:
                if rank == slow_rank:
                    end = time.perf_counter() + 0.03
                    while time.perf_counter() < end:
                        torch.tanh(torch.randn(64, 64) @ torch.randn(64, 64))
                h = torch.relu(layer(h))
                shared = h.detach().clone()
                dist.all_reduce(shared, group=tp)  # a tensor-parallel layer's all-reduce
            loss = h.pow(2).mean()
            loss.backward()
            for prm in layers.parameters():
                dist.all_reduce(prm.grad, group=dp)
            dist.all_reduce(loss.detach().clone())  # the logged loss, over everyone
            msg = torch.zeros(256)
            if rank < 2:
                dist.send(msg, peer, group=pp)
                dist.recv(msg, peer, group=pp)
            else:
                dist.recv(msg, peer, group=pp)
                dist.send(msg, peer, group=pp)
            layers.zero_grad()
            p.step()
    dist.destroy_process_group()


def test_gloo_traces_get_their_groups_inferred(tmp_path):
    """torch's gloo events name no process group: the replay tells each collective's group
    from the thread that ran it and each send's peer from the pair groups, so every
    instance matches across exactly its members; a rank waiting on a slow tensor-parallel
    peer inside its forward does not compute for the time it waited."""
    pytest.importorskip("torch")
    run_ranks("profiled_groups_train", 4, tmp_path, slow_rank=1)
    by_rank = defaultdict(list)
    for _t, _k, v, _ts in list(kineto_to_events([tmp_path], "gloo-groups"))[1:]:
        m = decode_steps(orjson.dumps(v))
        by_rank[m.rank].append(m)
    assert sorted(by_rank) == [0, 1, 2, 3]
    members: dict[str, set[int]] = defaultdict(set)
    per_step: dict[tuple[int, str], set[int]] = defaultdict(set)
    for r, ms in by_rank.items():
        assert len(ms) == 6
        for m in ms:
            for g, k in zip(m.group, m.kind, strict=True):
                if k == KIND_CODE["coll"]:
                    members[g].add(r)
            colls = [g for g, k in zip(m.group, m.kind, strict=True) if k == KIND_CODE["coll"]]
            for g in set(colls):
                per_step[(r, g)].add(colls.count(g))
    assert "pg.unknown" not in members
    # the groups are exactly the job's: two TP pairs, two DP pairs, everyone
    assert sorted(map(sorted, members.values())) == [[0, 1], [0, 1, 2, 3], [0, 2], [1, 3],
                                                     [2, 3]]
    world = next(g for g, rs in members.items() if len(rs) == 4)
    tp_of = {r: next(g for g, rs in members.items() if rs == {2 * (r // 2), 2 * (r // 2) + 1})
             for r in range(4)}
    dp_of = {r: next(g for g, rs in members.items() if rs == {r % 2, r % 2 + 2})
             for r in range(4)}
    for r in range(4):  # 3 TP all-reduces, 6 gradients, 1 loss, in every step
        assert per_step[(r, tp_of[r])] == {3} and per_step[(r, dp_of[r])] == {6}
        assert per_step[(r, world)] == {1}
    # the same collective instance has the same (group, seq) on every member
    keys = {r: {(g, int(q)) for m in ms for g, q, k in zip(m.group, m.seq, m.kind, strict=True)
                if k} for r, ms in by_rank.items()}
    for g, rs in members.items():
        own = [{key for key in keys[r] if key[0] == g} for r in sorted(rs)]
        assert all(o == own[0] and o for o in own), g
    # each pipeline pair's directions: the sender's send is its receiver's receive
    for src, dst in ((0, 2), (2, 0), (1, 3), (3, 1)):
        sent = {key for key in keys[src] if key[0].endswith(f".{src}-{dst}")}
        got = {key for key in keys[dst] if key[0].endswith(f".{src}-{dst}")}
        assert len(sent) == 6 and sent == got, (src, dst, sent, got)

    def fwd(r):  # a forward is cut around the all-reduces it waited in: its pieces' sum
        return np.median([sum(d for n, d in zip(m.name, m.dur_ns.tolist(), strict=True)
                              if n == "fwd") for m in by_rank[r]])

    # rank 1 computes 90 ms more per forward; rank 0 spends it waiting, not computing
    assert fwd(1) > 0.08e9 and fwd(0) < 0.5 * fwd(1)
