"""Benchmark: what a job split across workers leaves to its own worker, per step (issue #17).

Usage: python load-tests/bench_two_stage.py [--gpus 4096] [--shard-ranks 512] [--steps 3]
       [--microbatches 16] [--chunks 12]

One process, one core, the same simulated steps (~830 ops per rank) taken three ways:
- one worker: decode every rank's JSON message, assemble the step (`StepAssembler`);
- stage 1: the same per shard (`shard_ranks` ranks), then encode the shard's frame
  (`schemas.partial_frame`): work that spreads over the stage-1 workers;
- stage 2: decode the shards' frames and merge them (`ShardMerger`): the job's worker.
and the step analysis both paths end in (`JobDiagnoser.on_frame`, healthy steps). The job's
worker holds (decode + assemble + analysis) per step with one stage, (decode the partials +
merge + analysis) with two: their ratio is how much faster one job's worker can go when
stage 1 runs elsewhere. Medians over the timed steps; the first step (caches, interning)
is not timed. Every merged frame is checked equal to the one-worker frame.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import fields

import numpy as np
import orjson
from bench_header import header

from detectors.assembly import StepAssembler
from detectors.diagnoser import JobDiagnoser
from detectors.shard_merge import ShardMerger
from producers.simulator import ClusterSimulator, Scenario, layout_for_gpus
from schemas.frame import StepFrame
from schemas.partial_frame import decode_partial, encode_partial
from schemas.steps_decoder import StepsDecoder


def _same(a: StepFrame, b: StepFrame) -> bool:
    for f in fields(StepFrame):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if not (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y):
            return False
    return True


def _lz4_size(raw: bytes) -> int | None:
    try:
        import lz4.frame
    except ImportError:
        return None
    return len(lz4.frame.compress(raw))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=4096)
    ap.add_argument("--shard-ranks", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (one more is warm-up)")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=12)
    args = ap.parse_args()
    print(header(numpy=np.__version__))
    sc = Scenario(job="bench", layout=layout_for_gpus(args.gpus), steps=args.steps + 3, seed=1,
                  microbatches=args.microbatches, chunks=args.chunks, heartbeats=False)
    sim = ClusterSimulator(sc)
    frames = [f for f in sim.run() if isinstance(f, StepFrame)][1:args.steps + 2]
    steps = [[orjson.dumps(m.to_wire()) for m in sim.rank_steps(f)] for f in frames]
    R, S = args.gpus, args.shard_ranks
    ops = frames[0].n_ops
    print(f"load: {R} GPUs, {ops / R:.0f} ops per rank, {ops:,} ops per step, shards of {S} "
          f"ranks ({-(-R // S)} shards), {len(steps) - 1} timed steps after one warm-up")

    one_dec, one_asm = StepsDecoder(), StepAssembler("bench")
    shard_dec = {s: StepsDecoder() for s in range(-(-R // S))}
    shard_asm = {s: StepAssembler("bench") for s in shard_dec}
    merger = ShardMerger("bench")
    merger.world_size = one_asm.world_size = R
    for s, asm in shard_asm.items():  # its ranks (stage 1 learns them from the first step)
        asm.world_size = min(S, R - s * S)
    diag = JobDiagnoser("bench")
    t_one, t_stage1, t_stage1_max, t_stage2, t_analysis = [], [], [], [], []
    json_bytes = partial_bytes = 0
    lz_json = lz_partial = 0
    for i, msgs in enumerate(steps):
        t0 = time.process_time()
        [want] = [f for raw in msgs for f in one_asm.add(one_dec.decode(raw), 0)]
        t1 = time.process_time()
        parts, per_shard = [], []
        for s in shard_dec:
            a = time.process_time()
            asm = shard_asm[s]
            [f] = [f for raw in msgs[s * S:(s + 1) * S]
                   for f in asm.add(shard_dec[s].decode(raw), 0)]
            parts.append(encode_partial(f, shard=s, shard_ranks=S, watermark_ns=1))
            per_shard.append(time.process_time() - a)
        t2 = time.process_time()
        for raw in parts:
            merged = merger.add_partial(decode_partial(raw), 0)
        t3 = time.process_time()
        [got] = merged
        diag.on_frame(got)
        t4 = time.process_time()
        assert _same(want, got), f"step {want.step}: the merged frame differs"
        if i == 0:
            continue
        t_one.append(t1 - t0)
        t_stage1.append(t2 - t1)
        t_stage1_max.append(max(per_shard))
        t_stage2.append(t3 - t2)
        t_analysis.append(t4 - t3)
        json_bytes, partial_bytes = sum(map(len, msgs)), sum(map(len, parts))
        lz_json = sum(_lz4_size(m) or 0 for m in msgs[:64]) * len(msgs) / 64
        lz_partial = sum(_lz4_size(p) or 0 for p in parts)

    med = statistics.median
    one, stage2, analysis = med(t_one), med(t_stage2), med(t_analysis)
    print("\n| per step, CPU seconds (median) | s | µs per op |")
    print("|---|---:|---:|")
    for name, v in (("one worker: decode JSON + assemble", one),
                    ("stage 1, all shards: decode + assemble + encode", med(t_stage1)),
                    ("stage 1, the slowest shard", med(t_stage1_max)),
                    ("stage 2: decode the shards' frames + merge", stage2),
                    ("analysis (JobDiagnoser.on_frame, healthy step)", analysis)):
        print(f"| {name} | {v:.3f} | {v / ops * 1e6:.3f} |")
    print(f"\njob's worker per step: one stage {one + analysis:.3f} s, two stages "
          f"{stage2 + analysis:.3f} s: x{(one + analysis) / (stage2 + analysis):.2f} faster")
    print(f"bytes per op: JSON {json_bytes / ops:.1f}, partial frames {partial_bytes / ops:.1f}"
          + (f"; lz4: JSON {lz_json / ops:.1f}, partial frames {lz_partial / ops:.1f}"
             if lz_partial else ""))


if __name__ == "__main__":
    main()
