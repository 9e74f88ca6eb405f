"""Kineto replay: synthetic traces (every rule), the real public traces, and traces that
torch.profiler writes during a real gloo run in the suite."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import orjson
import pytest

from producers.kineto.names import canonical, comm_event_name, group_name, message_bytes
from producers.kineto.replay import KinetoError, kineto_to_events, trace_files
from schemas.decode import decode_job, decode_steps

REPO = Path(__file__).resolve().parents[4]
SHARED_TRACES = REPO.parent / "shared" / "traces"


def _x(name, ts, dur, cat="cpu_op", tid=1, pid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
            "args": args}


def gpu_trace(rank: int, slow: float = 1.0) -> dict:
    """Two steps of a modern NCCL trace: kernels carry the collective's args."""
    ev = []
    for i, t0 in enumerate((1000.0, 3000.0)):
        step = 10 + i
        ev.append(_x(f"ProfilerStep#{step}", t0, 1500.0, cat="user_annotation"))
        ev.append(_x("cudaLaunchKernel", t0 + 10, 5, cat="cuda_runtime", correlation=100 + i))
        ev.append(_x("ampere_sgemm_128x64", t0 + 20, 400.0 * slow, cat="kernel", pid=0, tid=7,
                     correlation=100 + i, device=rank))
        ev.append(_x("cudaLaunchKernel", t0 + 900, 5, cat="cuda_runtime", correlation=200 + i))
        ev.append(_x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", t0 + 1400, 600.0,
                     cat="kernel", pid=0, tid=20, correlation=200 + i, device=rank,
                     **{"Collective name": "allreduce", "In msg nelems": 1024,
                        "dtype": "BFloat16", "Process Group Name": "3",
                        "Process Group Description": "mesh_dp"}))
    return {"schemaVersion": 1, "baseTimeNanoseconds": 1_700_000_000_000_000_000,
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
            "traceEvents": ev}


def test_names_sizes_and_groups():
    assert canonical("allreduce") == "all_reduce"
    assert canonical("_allgather_base") == "all_gather"
    assert canonical("reduce_scatter_tensor_coalesced") == "reduce_scatter"
    assert comm_event_name("c10d::alltoall_base_") == "all_to_all"
    assert comm_event_name("gloo:send") == "send"
    assert comm_event_name("ncclKernel_ReduceScatter_RING_LL_Sum_float(x)") == "reduce_scatter"
    assert comm_event_name("aten::gather") is None
    assert message_bytes({"In msg nelems": 10, "dtype": "Float"}, "all_reduce") == 40
    assert message_bytes({"Input Dims": [[4], [8, 2]], "Input type": ["float", "half"]},
                         "all_gather") == 32
    assert message_bytes({"Input Dims": [[[64, 64]], []], "Input type": ["TensorList", ""]},
                         "all_reduce") == 0  # dtype unknown: 0, as the contract says
    assert group_name({"Process Group Name": "0", "Process Group Description": "default_pg"}) \
        == "world.0"
    assert group_name({"Process Group Name": "7", "Process Group Description": "tp"}) == "tp.7"
    assert group_name({"Process Group Name": "7", "Process Group Description": "undefined"}) \
        == "pg.7"
    assert group_name({}) == "pg.unknown"


def test_gpu_trace_becomes_steps_with_kernel_durations(tmp_path):
    for r in range(2):
        raw = json.dumps(gpu_trace(r, slow=3.0 if r == 1 else 1.0)).encode()
        (tmp_path / f"job_rank{r}.pt.trace.json.gz").write_bytes(gzip.compress(raw))
    events = list(kineto_to_events([tmp_path], "kj"))
    topic, key, value, ts = events[0]
    assert (topic, key) == ("flare.jobs.v1", "kj")
    job = decode_job(orjson.dumps(value))
    assert job.event == "start" and job.world_size == 2
    steps = [decode_steps(orjson.dumps(v)) for t, _k, v, _ts in events[1:]]
    assert [(s.rank, s.step) for s in steps] == [(0, 10), (1, 10), (0, 11), (1, 11)]
    assert [e[3] for e in events[1:]] == sorted(e[3] for e in events[1:])
    s0 = steps[0]
    assert s0.name == ["all_reduce", "gpu_compute"]
    assert s0.group == ["dp.3", ""]
    assert s0.bytes.tolist() == [2048, 0]
    assert s0.dur_ns.tolist() == [600_000, 400_000]
    assert s0.start_ns.tolist() == [1_400_000, 20_000]
    assert s0.t_start_ns == 1_700_000_000_000_000_000 + 1_000_000
    assert s0.t_end_ns == s0.t_start_ns + 2_000_000  # the kernel outlives the CPU span
    assert s0.seq[0] == (10 << 20) and steps[2].seq[0] == (11 << 20)
    assert steps[1].local_rank == 1
    assert steps[1].dur_ns[1] == 3 * steps[0].dur_ns[1]  # the slow rank's compute


def test_bad_inputs_say_what_is_wrong(tmp_path):
    with pytest.raises(KinetoError, match="no such file"):
        trace_files([tmp_path / "missing"])
    with pytest.raises(KinetoError, match="no trace files"):
        trace_files([tmp_path])
    (tmp_path / "a.json").write_text("{not json")
    with pytest.raises(KinetoError, match="not JSON"):
        list(kineto_to_events([tmp_path / "a.json"], "j"))
    (tmp_path / "b.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(KinetoError, match="ProfilerStep"):
        list(kineto_to_events([tmp_path / "b.json"], "j"))
    doc = gpu_trace(0)
    (tmp_path / "c.json").write_text(json.dumps(doc))
    (tmp_path / "d.json").write_text(json.dumps(doc))
    with pytest.raises(KinetoError, match="rank"):
        list(kineto_to_events([tmp_path / "c.json", tmp_path / "d.json"], "j"))


@pytest.mark.parametrize("name, world, n_steps, names", [
    ("a100-nccl-rank0-of-2.json.gz", 2, 3, {"all_reduce", "broadcast", "gpu_compute"}),
    ("a100-rank3-of-8.json.gz", 8, 6, {"all_reduce", "all_to_all", "gpu_compute"}),
])
def test_real_public_traces_are_accepted(name, world, n_steps, names):
    path = SHARED_TRACES / "hta" / name
    if not path.exists():
        pytest.skip(f"{path} not present")
    events = list(kineto_to_events([path], "hta"))
    assert decode_job(orjson.dumps(events[0][2])).world_size == world
    steps = [decode_steps(orjson.dumps(v)) for _t, _k, v, _ts in events[1:]]
    assert len(steps) == n_steps
    for s in steps:
        assert set(s.name) == names
        coll = s.kind == 1
        assert coll.sum() >= 3 and (s.dur_ns[coll] > 0).all() and (s.bytes[coll] > 0).all()
        assert s.t_end_ns - s.t_start_ns > 50_000_000  # 75–225 ms steps


# -- traces written by torch.profiler during a real gloo run ---------------------------------

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


@pytest.mark.torch
def test_traces_of_a_real_gloo_run(tmp_path):
    pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen(
        [sys.executable, "-c",
         f"from tests.unit.producers.kineto.test_trace import profiled_train; "
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
