"""Benchmark: telling older NCCL traces' groups from their CUDA streams, old search and new.

Usage: python load-tests/bench_streams.py [--gpus 256,512,1024,2048,8192] [--steps 10]
       [--rounds 3] [--old-max 2048] [--old-rev 1998c10]

For each cluster size a job is simulated (not timed) and its ranks' NCCL streams are made
into the lanes `trace.stream_ops` reads from the trace files torch < 2.2 writes (no process
group anywhere; times in whole µs on each node's clock, up to ±5 ms apart; each copy of an
instance ending up to 3 µs from the others, a hop); then `streams.assign_streams` is timed
on them:

- old: the module as of `--old-rev` (read with `git show`), which judges every pair of
  lanes of a bucket: quadratic in the ranks, so only up to `--old-max` GPUs;
- new: the module in the work tree, which judges the pairs `lane_pairs` picks.

Both run `--rounds` times in turn on the same lanes; the table gives the median CPU
seconds of this process (numpy runs on one core here), whether the two return identical
groups (the same dict), and whether the groups are the simulator's own. The pairs of lanes
in the buckets and the pairs the new search judges (medians over all their ops) are
counted in a run of their own (`streams.Weighed`), not timed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from bench_header import header

from producers.kineto import streams
from producers.kineto.groups import ProcessGroup, ThreadOps
from producers.simulator import ClusterSimulator, Scenario, layout_for_gpus

Lane = tuple[int, str]
ROOT = Path(__file__).resolve().parent.parent


def simulated(gpus: int, steps: int, seed: int) -> list[dict[str, Any]]:
    sc = Scenario(job="bench", layout=layout_for_gpus(gpus), steps=steps, seed=seed,
                  heartbeats=False)
    return [v for _t, _k, v, _ts in ClusterSimulator(sc).events() if "ops" in v]


def older_lanes(messages: list[dict[str, Any]], seed: int
                ) -> tuple[dict[Lane, ThreadOps], dict[int, str]]:
    """(rank, stream) → its NCCL ops, and each rank's node, as the replay reads them from
    older traces: a stream per group on each rank (a pipeline pair's sends and receives on
    the pair's), whole µs on the node's clock turned into ns as the parser does (float
    µs × 1000, so ns near 2⁶⁰ carry its rounding), a hop of 0–3 µs on each copy's end."""
    rng = np.random.default_rng(seed)
    skew: dict[str, int] = {}
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for m in messages:
        by_rank.setdefault(m["rank"], []).append(m)
    lanes: dict[Lane, ThreadOps] = {}
    nodes: dict[int, str] = {}
    for rank, msgs in sorted(by_rank.items()):
        nodes[rank] = node = msgs[0]["node"]
        us0 = skew.setdefault(node, int(rng.integers(-5_000, 5_000)))
        cols: dict[str, tuple[list[str], list[int], list[int], list[int]]] = {}
        for m in msgs:
            ops = m["ops"]
            comm = np.flatnonzero(np.asarray(ops["kind"]) != "compute")
            t0 = m["t_start_ns"]
            start = (t0 + np.asarray(ops["start_ns"])[comm]) // 1000 + us0
            end = (t0 + np.asarray(ops["start_ns"])[comm] + np.asarray(ops["dur_ns"])[comm]) \
                // 1000 + us0 + rng.integers(0, 4, size=comm.size)
            for i, s, e in zip(comm.tolist(), start.tolist(), end.tolist(), strict=True):
                group = ops["group"][i]
                stream = ("pair:" if ops["kind"][i] == "p2p" else "") + group
                names, ends, durs, step = cols.setdefault(stream, ([], [], [], []))
                names.append(ops["name"][i])
                ends.append(int(round(s * 1000.0)) + (e - s) * 1000)
                durs.append((e - s) * 1000)
                step.append(m["step"])
        for i, c in enumerate(cols.values()):  # a stream's number differs from rank to rank
            lanes[(rank, str(13 + 4 * i + rank % 3))] = ThreadOps.of(*c)
    return lanes, nodes


def simulator_groups(messages: list[dict[str, Any]]) -> set[tuple[int, ...]]:
    """The member ranks of every group the job ran (a pipeline pair's included)."""
    members: dict[str, set[int]] = {}
    for m in messages:
        for g in m["ops"]["group"]:
            members.setdefault(g, set()).add(m["rank"])
    return {tuple(sorted(rs)) for g, rs in members.items() if g and len(rs) > 1}


def old_module(rev: str) -> types.ModuleType:
    """`producers/kineto/streams.py` as of `rev`, loaded as a module of its own."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:producers/kineto/streams.py"],
                         check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType("streams_old")
    exec(compile(src, f"streams.py@{rev}", "exec"), mod.__dict__)
    return mod


Assign = Callable[[Mapping[Lane, ThreadOps], Mapping[int, tuple[ProcessGroup, ...]],
                   Mapping[int, str]], dict[Lane, ProcessGroup]]


def cpu_s(fn: Assign, lanes: dict[Lane, ThreadOps], nodes: dict[int, str]
          ) -> tuple[float, dict[Lane, ProcessGroup]]:
    t0 = time.process_time()
    out = fn(lanes, {}, nodes)
    return time.process_time() - t0, out


def weighed(lanes: dict[Lane, ThreadOps], nodes: dict[int, str]) -> streams.Weighed:
    """What the new search weighs on these lanes (one untimed run, counted)."""
    out = streams.Weighed()
    streams.assign_streams(lanes, {}, nodes, weighed=out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="256,512,1024,2048,8192",
                    help="cluster sizes, comma-separated (powers of two)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old-max", type=int, default=2048,
                    help="the largest cluster the old search is timed on")
    ap.add_argument("--old-rev", default="1998c10",
                    help="the commit whose streams.py is the old search")
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args()
    old = old_module(args.old_rev)
    rows = []
    for gpus in map(int, args.gpus.split(",")):
        msgs = simulated(gpus, args.steps, args.seed)
        lanes, nodes = older_lanes(msgs, args.seed)
        truth = simulator_groups(msgs)
        del msgs
        count = weighed(lanes, nodes)
        new_t, old_t = [], []
        same: bool | None = None
        for _ in range(args.rounds):
            t, found = cpu_s(streams.assign_streams, lanes, nodes)
            new_t.append(t)
            if gpus <= args.old_max:
                t, ref = cpu_s(old.assign_streams, lanes, nodes)
                old_t.append(t)
                same = found == ref and same is not False
        real = {g.ranks for g in found.values()} == truth
        rows.append((gpus, len(lanes), count.pairs, count.judged, old_t, new_t, same, real))
        print(f"  {gpus} GPUs done: new {statistics.median(new_t):.2f} s", file=sys.stderr)

    print(header(numpy=np.__version__))
    print(f"lanes: {args.steps} steps of the simulator's default job (TP8 inside a node, PP "
          f"and DP across), old = streams.py at {args.old_rev}; median CPU s of "
          f"{args.rounds} rounds")
    print()
    print("| GPUs | lanes | pairs in buckets | pairs judged (new) | old s | new s | old / new "
          "| identical groups | = simulator's groups |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for gpus, n, every, judged, old_t, new_t, same, real in rows:
        o = statistics.median(old_t) if old_t else None
        nw = statistics.median(new_t)
        print(f"| {gpus:,} | {n:,} | {every:,} | {judged:,} | "
              f"{f'{o:.2f}' if o is not None else '—'} | {nw:.2f} | "
              f"{f'{o / nw:.1f}×' if o is not None else '—'} | "
              f"{'—' if same is None else 'yes' if same else 'NO'} | {'yes' if real else 'NO'} |")


if __name__ == "__main__":
    main()
