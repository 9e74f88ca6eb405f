"""Benchmark: the detectors alone on whole 8,192-GPU steps with ~800 ops per rank.

Usage: python load-tests/bench_detectors.py [--gpus 8192] [--microbatches 16] [--chunks 12]
       [--steps 7] [--traced all|tp0|half|node_dark] [--fault slow_gpu:1.5]
Steps are simulated first (not timed), then fed to one JobDiagnoser on one core; the
median of the timed steps is reported, with the split between the stages, and the cost of
assembling the same step from its 8,192 per-rank messages (what the worker does before).
With `--fault FAMILY:SEVERITY` the fault is there from the first step and the timed steps
begin once its incident is open, so they include pricing it (`detectors/whatif.py`) on
every step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from bench_header import header

from detectors.assembly import StepAssembler
from detectors.compute_suspects import compute_ratio
from detectors.diagnoser import JobDiagnoser
from detectors.features import step_features
from detectors.network_suspects import Topology, transfer_reference
from detectors.noise import NoiseMemory
from detectors.peers import stage_keys
from detectors.suspects import step_suspects
from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus

WARM_STEPS = 2  # baselines, membership, numpy caches
OPEN_STEPS = 12  # with a fault: at most this many steps until its incident is open


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8192)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--traced", default="all", help="which ranks report (partial tracing)")
    ap.add_argument("--fault", default="", help="FAMILY:SEVERITY from the first step")
    args = ap.parse_args()
    fault = None
    if args.fault:
        family, _, severity = args.fault.partition(":")
        fault = Fault(family, float(severity or 1.5), onset_step=0)
    n_warm = OPEN_STEPS if fault else WARM_STEPS
    sc = Scenario(
        job="bench",
        layout=layout_for_gpus(args.gpus),
        steps=args.steps + n_warm,
        fault=fault,
        seed=1,
        microbatches=args.microbatches,
        chunks=args.chunks,
        heartbeats=False,
        traced=args.traced,
    )
    sim = ClusterSimulator(sc)
    frames = list(sim.run())
    n_ops = frames[0].n_ops
    n_ranks = frames[0].n_ranks
    diag = JobDiagnoser("bench")
    diag.on_job(sim.job_start())
    seen = 0
    for f in frames[:n_warm]:
        diag.on_frame(f)
        seen += 1
        if fault and diag.book.open and seen >= WARM_STEPS:
            break
    whole, feat_t, susp_t, opened, priced = [], [], [], 0, []
    for f in frames[seen:seen + args.steps]:
        t0 = time.perf_counter()
        diag.on_frame(f)
        whole.append(time.perf_counter() - t0)
        opened += bool(diag.book.open)
        if any(i.priced_step == f.step for i in diag.book.open.values()):
            priced.append(whole[-1])
        t0 = time.perf_counter()
        feats = step_features(f)
        t1 = time.perf_counter()
        ref = transfer_reference(feats.inst)
        stages = stage_keys(f)
        ratio = compute_ratio(f, feats, stages)
        step_suspects(f, feats, ratio, Topology(), ref, NoiseMemory(), stages)
        t2 = time.perf_counter()
        feat_t.append(t1 - t0)
        susp_t.append(t2 - t1)
    warm = sim.rank_steps(frames[2])  # a job's op names and groups repeat step after step
    asm_t = []
    for f in frames[3:6]:
        asm = StepAssembler("bench")
        asm.world_size = len(warm)
        for m in warm:
            asm.add(m, m.t_end_ns)
        msgs = sim.rank_steps(f)
        t0 = time.perf_counter()
        for m in msgs:
            asm.add(m, m.t_end_ns)
        asm_t.append(time.perf_counter() - t0)
    med = statistics.median(whole)
    print(header(numpy=np.__version__))
    print(f"step: {n_ranks} of {args.gpus} ranks traced ({args.traced}), "
          f"{n_ops / n_ranks:.0f} ops per rank, {n_ops:,} ops")
    if fault:
        print(f"fault: {args.fault}; an incident open in {opened} of {len(whole)} timed steps, "
              f"its what-if replayed in {len(priced)} (the detectors' `price_ops`)")
        if priced:
            print(f"median s per step with the what-if replayed: {statistics.median(priced):.3f}")
    print("| stage | median s per step | ops/s |")
    print("|---|---:|---:|")
    print(f"| detectors, whole step (JobDiagnoser.on_frame) | {med:.3f} | {n_ops / med:,.0f} |")
    print(f"| of which step features | {statistics.median(feat_t):.3f} | |")
    print(f"| of which suspects | {statistics.median(susp_t):.3f} | |")
    print(f"mean s per step, periodic work included (group membership, node clocks): "
          f"{statistics.mean(whole):.3f}")
    asm = statistics.median(asm_t)
    print(f"| assembly of {len(warm)} rank messages (steady) | {asm:.3f} | {n_ops / asm:,.0f} |")


if __name__ == "__main__":
    main()
