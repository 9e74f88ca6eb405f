"""Synthetic Kineto traces shared by the trace, replay and streams tests: the modern NCCL
kind (`nccl_trace`), and an older kind made from simulated steps (`older_nccl_traces`, and
the streams' ops the replay reads from them, `older_nccl_lanes`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from producers.kineto.groups import ThreadOps


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


_NCCL_KERNEL = {  # wire name → the kernel NCCL 2.1x runs it as
    "all_reduce": "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, "
                  "ncclWork*)",
    "all_gather": "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, "
                  "ncclWork*)",
    "reduce_scatter": "ncclKernel_ReduceScatter_RING_LL_Sum_float(ncclDevComm*, unsigned "
                      "long, ncclWork*)",
    "broadcast": "ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, "
                 "ncclWork*)",
}
_SENDRECV = "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"


def older_nccl_traces(messages: list[dict], seed: int = 0, labelled: bool = False
                      ) -> dict[str, dict]:
    """Simulated steps messages as the trace files torch < 2.2 writes for NCCL training, by
    file name (`<host>_<pid>.<ts>.pt.trace.json`): no process group in any arg and no
    `pg_config`; each group's kernels on a CUDA stream of its own on each rank (numbered
    differently on each), a pipeline pair's sends and receives on the pair's stream; the
    `nccl:*` annotations that issued them on the CPU; times in whole µs on each node's own
    clock, and each copy of an instance ending up to 3 µs from the others (a hop)."""
    rng = np.random.default_rng(seed)
    skew_us: dict[str, int] = {}
    by_rank: dict[int, list[dict]] = {}
    for m in messages:
        by_rank.setdefault(m["rank"], []).append(m)
    out = {}
    for rank, msgs in sorted(by_rank.items()):
        node = msgs[0]["node"]
        skew = skew_us.setdefault(node, int(rng.integers(-5_000, 5_000)))
        streams: dict[str, int] = {}
        ev: list[dict] = []
        corr = 0

        def us(ns: int, skew: int = skew) -> int:
            return ns // 1000 + skew

        for m in msgs:
            t0 = m["t_start_ns"]
            ev.append(_x(f"ProfilerStep#{m['step']}", us(t0), us(m["t_end_ns"]) - us(t0),
                         cat="user_annotation"))
            ops = m["ops"]
            for kind, name, group, st, dur, nbytes in zip(
                    ops["kind"], ops["name"], ops["group"], ops["start_ns"], ops["dur_ns"],
                    ops["bytes"], strict=True):
                corr += 1
                start = us(t0 + st)
                end = us(t0 + st + dur) + int(rng.integers(0, 4))
                ev.append(_x("cudaLaunchKernel", start, 1, cat="cuda_runtime",
                             correlation=corr))
                if kind == "compute":
                    ev.append(_x("sm80_xmma_gemm_f16f16_f16f32", start, end - start,
                                 cat="kernel", pid=0, tid=7, correlation=corr,
                                 device=m["local_rank"], stream=7))
                    continue
                lane = group if kind != "p2p" else "pair:" + group
                stream = streams.setdefault(lane, 13 + 4 * len(streams) + rank % 3)
                pg = {"Process Group Name": group} if labelled else {}
                ev.append(_x(f"nccl:{name}", start, 1, cat="user_annotation",
                             **{"Input Dims": [[nbytes // 4]], "Input type": ["float"]}, **pg))
                ev.append(_x(_SENDRECV if kind == "p2p" else _NCCL_KERNEL[name], start,
                             end - start, cat="kernel", pid=0, tid=stream, correlation=corr,
                             device=m["local_rank"], stream=stream))
        doc = {"schemaVersion": 1,
               "distributedInfo": {"backend": "nccl", "rank": rank,
                                   "world_size": len(by_rank)},
               "traceEvents": ev}
        out[f"{node}_{1000 + rank}.{1700000000 + rank}.pt.trace.json"] = doc
    return out


def older_nccl_lanes(messages: list[dict], seed: int = 0
                     ) -> tuple[dict[tuple[int, str], ThreadOps], dict[int, str]]:
    """What `trace.stream_ops` reads from `older_nccl_traces(messages, seed)`, by (rank,
    stream), and each rank's node, without writing and parsing the files: the same draws of
    the same generator (a node's clock, each op's hop), the same µs, turned into ns as the
    parser does (float µs × 1000). Large jobs' traces take minutes to write and parse."""
    rng = np.random.default_rng(seed)
    skew_us: dict[str, int] = {}
    by_rank: dict[int, list[dict]] = {}
    for m in messages:
        by_rank.setdefault(m["rank"], []).append(m)
    lanes: dict[tuple[int, str], ThreadOps] = {}
    nodes: dict[int, str] = {}
    for rank, msgs in sorted(by_rank.items()):
        nodes[rank] = node = msgs[0]["node"]
        skew = skew_us.setdefault(node, int(rng.integers(-5_000, 5_000)))
        streams: dict[str, str] = {}
        cols: dict[str, tuple[list[str], list[int], list[int], list[int]]] = {}
        for m in msgs:
            t0, ops = m["t_start_ns"], m["ops"]
            for kind, name, group, st, dur in zip(ops["kind"], ops["name"], ops["group"],
                                                  ops["start_ns"], ops["dur_ns"], strict=True):
                start = (t0 + st) // 1000 + skew
                end = (t0 + st + dur) // 1000 + skew + int(rng.integers(0, 4))
                if kind == "compute":
                    continue
                lane = group if kind != "p2p" else "pair:" + group
                stream = streams.setdefault(lane, str(13 + 4 * len(streams) + rank % 3))
                names, ends, durs, steps = cols.setdefault(stream, ([], [], [], []))
                names.append(name)
                ends.append(int(round(start * 1000.0)) + (end - start) * 1000)
                durs.append((end - start) * 1000)
                steps.append(m["step"])
        lanes.update({(rank, s): ThreadOps.of(*c) for s, c in cols.items()})
    return lanes, nodes
