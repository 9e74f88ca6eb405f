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

pytestmark = pytest.mark.torch

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


def test_traces_of_a_real_gloo_run(tmp_path):
    pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen(
        [sys.executable, "-c",
         f"from tests.integration.test_kineto_gloo import profiled_train; "
                               f"profiled_train({r}, 2, {port}, {str(tmp_path)!r}, 1)"],
        cwd=REPO, env=env) for r in range(2)]
    try:
        for p in procs:
            assert p.wait(120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
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
