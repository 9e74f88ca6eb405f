"""Benchmark: the detectors on a large job's heartbeats, long steps, nothing wrong.

Usage: python load-tests/bench_heartbeats.py [--gpus 8192] [--step-s 30] [--steps 4]

A rank's agent sends a heartbeat every few seconds whatever the step time, so a job of
30 s steps sends about fifteen times the heartbeats per step of a job of 2 s steps: at
8,192 GPUs about 70,000 a step, 2,400 a second. Every one goes through
`JobDiagnoser.on_heartbeat` (the hang detector's view of the rank, stacks, and the check for
a hang). The job is simulated first (not timed); then its frames and heartbeats, in stream
order, are fed to one diagnoser on one core after a warm-up step, and the heartbeats' share
is reported: microseconds per heartbeat and the seconds a step's heartbeats take. Times are
the process's CPU time (`time.process_time`) over each run of consecutive heartbeats (or
steps), not wall time: on shared cores a wall clock counts the other processes' turns, CPU
time this one's work; one reading per run, not per heartbeat, so the clock's own cost stays
out.
"""

from __future__ import annotations

import argparse
import time
from itertools import groupby

from bench_header import header

from detectors.diagnoser import DiagnoserOutput, JobDiagnoser
from producers.simulator import ClusterSimulator, Scenario, layout_for_gpus
from schemas.frame import StepFrame

WARM_STEPS = 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8192)
    ap.add_argument("--step-s", type=float, default=30.0)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    sc = Scenario(job="bench", layout=layout_for_gpus(args.gpus),
                  steps=args.steps + WARM_STEPS, seed=1, heartbeats=True,
                  step_time_s=args.step_s)
    sim = ClusterSimulator(sc)
    items = list(sim.run())
    diag = JobDiagnoser("bench")
    diag.on_job(sim.job_start())
    frames = [i for i, x in enumerate(items) if isinstance(x, StepFrame)]
    warm_end = frames[WARM_STEPS - 1] + 1
    ids: set[str] = set()
    for x in items[:warm_end]:
        ids.update(i.id for i in _feed(diag, x).incidents)
    hb_s, n_hb, frame_s, n_frames = 0.0, 0, 0.0, 0
    for frames_run, run in groupby(items[warm_end:], key=lambda x: isinstance(x, StepFrame)):
        batch = list(run)
        t0 = time.process_time()
        for x in batch:
            ids.update(i.id for i in _feed(diag, x).incidents)
        took = time.process_time() - t0
        if frames_run:
            frame_s, n_frames = frame_s + took, n_frames + len(batch)
        else:
            hb_s, n_hb = hb_s + took, n_hb + len(batch)
    print(header())
    print(f"job: {args.gpus} GPUs, {args.step_s:g} s steps, {n_frames} timed steps, "
          f"{n_hb:,} heartbeats ({n_hb / max(n_frames, 1):,.0f} a step), "
          f"{len(ids)} incidents")
    print("| stage | CPU per step (s) | CPU per heartbeat (µs) |")
    print("|---|---:|---:|")
    print(f"| heartbeats (JobDiagnoser.on_heartbeat) | {hb_s / max(n_frames, 1):.3f} | "
          f"{1e6 * hb_s / max(n_hb, 1):.1f} |")
    print(f"| steps (JobDiagnoser.on_frame) | {frame_s / max(n_frames, 1):.3f} | |")


def _feed(diag: JobDiagnoser, x: object) -> DiagnoserOutput:
    if isinstance(x, StepFrame):
        return diag.on_frame(x)
    return diag.on_heartbeat(x)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
