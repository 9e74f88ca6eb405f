"""A synthetic Kineto trace of the modern NCCL kind, shared by the trace and replay tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


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


@pytest.fixture
def nccl_trace() -> Callable[..., dict[str, Any]]:
    """`nccl_trace(rank, slow=1.0)`: two steps of one rank (a slow rank's GEMM takes longer)."""
    return gpu_trace
