"""The pipeline benchmark's measurements and its markdown report.

What a run collects (`Sample` per sampling tick, `Outcome` at the end) and how it is turned
into the tables pasted into BENCHMARKS.md: throughput over the measuring window, lag per
sample and its trend (paced runs), and where the worker's time goes (a py-spy profile).
Every figure comes from the worker's own progress and our producer's acknowledgements,
never from the broker's end offsets (tansu's are off by a batch).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pipeline_workload import Workload

from flare.settings import Settings
from schemas.topics import INPUT_TOPICS as INPUTS


@dataclass(slots=True)
class Sample:
    t: float  # wall seconds since the worker started consuming (or publishing began)
    taken: dict[str, int]  # messages the worker took, per input topic (its processed offsets)
    delivered: dict[str, int]  # messages the broker acknowledged to us, per topic
    reports: int  # steps diagnosed and stored
    worker_lag: int  # the worker's own lag estimate (fetch high watermarks - processed)
    cpu: dict[str, float]  # CPU seconds: worker, tansu, bench, machine busy / total jiffies
    rss: dict[str, float] = field(default_factory=dict)


@dataclass
class Outcome:
    """Everything a run measured, for the report."""

    samples: list[Sample]
    final: dict[str, Any]  # the worker's last /worker/stats
    stored: Any  # /v1/jobs/{job}
    series: Any  # /v1/jobs/{job}/steps
    ranks: Any  # /v1/jobs/{job}/ranks at the newest step
    assignments: int  # "assigned partitions" lines in the worker's log (1 = no rebalance)
    publish_s: float  # pre-load time (throughput mode)
    published: int
    profile: tuple[list[tuple[str, float]], list[tuple[str, float]]]  # buckets, functions
    profile_at: float | None


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


BUCKETS = (  # first match wins, from the leaf up: where the worker's time goes
    ("sink: ClickHouse insert (chDB)", ("insert_arrow", "chdb")),
    ("sink: Arrow conversion", ("writer.py",)),  # storage/writer.py
    ("detectors: step analysis (on_frame)", ("on_frame",)),
    ("detectors: step assembly", ("assembly.py",)),
    ("decode: JSON -> RankStep (msgspec, numpy)", ("decode.py", "steps_decoder.py", "rankstep.py",
                                                   "wire.py")),
    ("heartbeats, hang check, tick", ("on_heartbeat", "hang.py", "routing.py:tick")),
    ("pipeline, merge, routing", ("pipeline.py", "ordering.py", "routing.py", "progress.py")),
    ("Kafka client: fetch, records (aiokafka)", ("aiokafka",)),
    ("faust/mode stream machinery", ("faust", "mode/")),
)


_LINE = re.compile(r":\d+\)$")


def profile_tables(path: Path, seconds: float, rate: int = 50
                   ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Share of wall time per bucket (a sample counts in the first bucket any frame hits),
    and the functions where the samples were taken (self time, top 12)."""
    buckets: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    if not path.exists():
        return [], []
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        thread, *frames = stack.split(";")
        if not frames:
            continue
        if frames[-1].startswith("EpollSelector.select"):
            continue  # waiting (py-spy may sample a thread inside select as active)
        if "MainThread" not in thread:  # faust runs the aiokafka consumer in its own thread
            buckets["(other threads: the aiokafka consumer thread, HTTP)"] += int(n)
            continue
        label = "other Python"
        for name, needles in BUCKETS:
            if any(nd in fr for fr in frames for nd in needles):
                label = name
                break
        buckets[label] += int(n)
        leaves[_LINE.sub(")", frames[-1])] += int(n)
    wall = seconds * rate
    other = buckets.pop("(other threads: the aiokafka consumer thread, HTTP)", 0)
    rows = [(k, v / wall) for k, v in buckets.most_common()]
    rows.append(("main thread idle (waiting for records or I/O)",
                 max(0.0, 1 - sum(buckets.values()) / wall)))
    rows.append(("(other threads: the aiokafka consumer thread, HTTP)", other / wall))
    return rows, [(k, v / wall) for k, v in leaves.most_common(12)]


def _at(arr: np.ndarray, n: int) -> int:
    """Value of a per-offset array after n messages (0 before any)."""
    return int(arr[min(n, len(arr)) - 1]) if n > 0 else 0


def _window(samples: list[Sample], paced: bool) -> tuple[Sample, Sample]:
    """The measuring window. Paced: the run after its first minute. Throughput: the whole
    drain, from the worker's readiness to the sample where its last step was stored, with
    everything it took meanwhile (a job's heartbeats are fetched ahead of its steps, so a
    window between stored steps would leave some of them out)."""
    if paced:
        win = [s for s in samples if s.t >= min(60.0, samples[-1].t / 4)]
    else:
        end = next((i for i, s in enumerate(samples) if s.reports >= samples[-1].reports),
                   len(samples) - 1)
        win = samples[:end + 1]
    return (win[0], win[-1]) if len(win) >= 2 else (samples[0], samples[-1])


def report(args: argparse.Namespace, wl: Workload, steps: int, out: Outcome, gen_s: float,
           load0: tuple[float, float, float]) -> None:
    paced = args.speed > 0
    ncpu = os.cpu_count() or 1
    load1 = os.getloadavg()
    index = {t: wl.topic_index(t, steps) for t in INPUTS}
    step_ts, cum_ops = index[wl.steps_topic]
    ops_per_rank = cum_ops[-1] / len(step_ts)
    sim_step_s = wl.period_ns / wl.distinct / 1e9
    mode = f"paced x{args.speed:g}" if paced else "throughput (pre-loaded backlog)"
    print(f"\n## Pipeline benchmark: {wl.world:,} GPUs, {mode}\n")
    print(f"- command: `python load-tests/{Path(sys.argv[0]).name} {shlex.join(sys.argv[1:])}`")
    print(f"- machine: {ncpu} cores, {cpu_model()}, {platform.system()} {platform.release()}, "
          f"Python {platform.python_version()}; load average before "
          f"{load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, after "
          f"{load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}")
    hb = "on (agent cadence: 1 Hz samples, keepalive 5 s)" if wl.heartbeats else "off"
    pre = f"; pre-load of {out.published:,} messages {out.publish_s:.1f} s" if not paced else ""
    print(f"- steps on `{wl.steps_topic}`; job: {wl.world:,} ranks, {ops_per_rank:.0f} ops per "
          "rank-step, simulated step "
          f"{sim_step_s:.2f} s, {steps} steps (cycling {wl.distinct} simulated steps), "
          f"heartbeats {hb}; generation {gen_s:.1f} s (not measured){pre}")
    wait = (Settings().kafka_fetch_max_wait_ms if args.fetch_max_wait_ms is None
            else args.fetch_max_wait_ms)
    fetch = f"fetch wait {wait} ms (faust's own is 1,500 ms)"
    print("- stack: tansu (memory storage) + one `flare worker` process (faust-streaming, "
          f"embedded chDB), loopback; {fetch}")

    s = out.samples
    a, b = _window(s, paced)
    dt = max(b.t - a.t, 1e-9)
    d_steps = b.reports - a.reports
    steps_topic = wl.steps_topic
    taken = b.taken[steps_topic] - a.taken[steps_topic]
    ops = _at(cum_ops, b.taken[steps_topic]) - _at(cum_ops, a.taken[steps_topic])
    # simulated seconds taken per wall second, from the rank-step rate (the stream time of
    # the offsets taken moves in steps of a whole step, too coarse for a short window)
    rtf = taken / dt * sim_step_s / wl.world
    msgs = sum(b.taken.values()) - sum(a.taken.values())
    cpu = {k: (b.cpu[k] - a.cpu[k]) / dt for k in ("worker", "tansu", "bench")}
    busy = (b.cpu["busy"] - a.cpu["busy"]) / max(b.cpu["total"] - a.cpu["total"], 1) * ncpu
    others = max(0.0, busy - sum(cpu.values()))
    print(f"\n| figure (window {a.t:.0f}–{b.t:.0f} s of the run) | value |")
    print("|---|---:|")
    print(f"| steps diagnosed and stored in the window | {d_steps} |")
    print(f"| rank-steps/s through to ClickHouse (stored steps x ranks) | "
          f"{d_steps * wl.world / dt:,.0f} |")
    print(f"| rank-steps/s taken by the worker (its processed offsets) | {taken / dt:,.0f} |")
    print(f"| ops/s (ops of the rank-steps taken) | {ops / dt:,.0f} |")
    print(f"| input messages/s (steps + heartbeats + job events) | {msgs / dt:,.0f} |")
    print(f"| rank-steps/s the job produces in real time | {wl.world / sim_step_s:,.0f} |")
    print(f"| real-time factor (simulated s taken per wall s) | {rtf:.2f} |")
    print(f"| worker CPU, cores / ms per rank-step taken | {cpu['worker']:.2f} / "
          f"{1e3 * cpu['worker'] * dt / max(taken, 1):.2f} |")
    print(f"| CPU of tansu / the bench / everything else on the machine, cores | "
          f"{cpu['tansu']:.2f} / {cpu['bench']:.2f} / {others:.2f} |")
    print(f"| RSS at the end, worker / tansu, MB | {s[-1].rss['worker']:,.0f} / "
          f"{s[-1].rss['tansu']:,.0f} |")
    if paced:
        lag_table(s, wl, {t: ix[0] for t, ix in index.items()}, sim_step_s)
    stored, series, ranks, final = out.stored, out.series, out.ranks, out.final
    n_stored = stored.get("steps") if isinstance(stored, dict) else stored
    pts = series.get("steps", []) if isinstance(series, dict) else []
    full = sum(1 for p in pts if p.get("n_ranks") == wl.world and p.get("n_missing") == 0)
    partial = [f"{p.get('step')} ({p.get('n_ranks')} ranks)" for p in pts
               if p.get("n_ranks") != wl.world or p.get("n_missing")]
    n_rows = len(ranks.get("ranks", [])) if isinstance(ranks, dict) else 0
    print(f"\nClickHouse, read back through the API: {n_stored} steps stored of {steps} "
          f"published, {full} of them with all {wl.world:,} ranks; {n_rows:,} rank_steps rows "
          f"at the newest step. Worker counters: {final.get('records', 0):,} records in "
          f"{final.get('batches', 0):,} batches, "
          f"{final.get('reports', 0)} step reports, dead letters "
          f"{final.get('dead_letters', {}).get('total', final.get('dead_letters'))}, forced "
          f"order releases {final.get('forced_order_releases')} (waiting on: "
          f"{final.get('forced_order_releases_waiting_on')}), re-delivered and skipped "
          f"{final.get('skipped_redelivered')}, partition assignments {out.assignments} "
          "(1 = no rebalance)." + (f" Steps stored incomplete: {', '.join(partial[:10])}."
                                   if partial else ""))
    buckets, functions = out.profile
    if buckets:
        print(f"\nWorker profile: py-spy, {args.profile_s:.0f} s from t={out.profile_at:.0f} s; "
              "share of the main thread's wall time (where faust runs the agent), a sample "
              "counted in the first of these it touches:\n")
        print("| where | share |")
        print("|---|---:|")
        for name, share in buckets:
            print(f"| {name} | {100 * share:.0f}% |")
        print("\n| main thread: function where the sample was taken (self time) | share |")
        print("|---|---:|")
        for name, share in functions:
            print(f"| `{name}` | {100 * share:.1f}% |")


def backlog_age_s(s: Sample, ts: dict[str, np.ndarray]) -> float:
    """Lag in simulated seconds: how much older than the newest message the broker has
    acknowledged is the oldest message the worker has not taken yet (0: nothing waiting).
    Unlike "newest acknowledged - newest taken" it does not jump by a whole step when the
    burst of a step's rank messages has just arrived."""
    newest = max((int(ts[t][n - 1]) for t in INPUTS
                  if (n := min(s.delivered.get(t, 0), len(ts[t]))) > 0), default=0)
    ages = [newest - int(ts[t][s.taken[t]]) for t in INPUTS
            if s.taken[t] < min(s.delivered.get(t, 0), len(ts[t]))]
    return max(0.0, max(ages, default=0) / 1e9)


def lag_table(samples: list[Sample], wl: Workload, ts: dict[str, np.ndarray],
              sim_step_s: float) -> None:
    """Lag per sample, ours (acknowledged - taken) and the worker's own, and its trend."""
    print("\n| wall s | step msgs published | taken | lag, msgs | worker's own lag, msgs "
          "| lag, simulated s | steps published - stored | worker cores | tansu cores | "
          "worker RSS, MB | tansu RSS, MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lags, times, published = [], [], []
    prev: Sample | None = None
    for s in samples:
        pub_n, took = s.delivered.get(wl.steps_topic, 0), s.taken[wl.steps_topic]
        lag_msgs = max(0, sum(s.delivered.get(t, 0) for t in INPUTS) - sum(s.taken.values()))
        lag_s = backlog_age_s(s, ts)
        behind = max(0, pub_n // wl.world - s.reports)
        dt = max(s.t - prev.t, 1e-9) if prev is not None else 0.0
        cores, broker = ((s.cpu["worker"] - prev.cpu["worker"]) / dt,
                         (s.cpu["tansu"] - prev.cpu["tansu"]) / dt) if prev else (0.0, 0.0)
        prev = s
        lags.append(lag_s)
        times.append(s.t)
        published.append(sum(s.delivered.values()))
        print(f"| {s.t:.0f} | {pub_n:,} | {took:,} | {lag_msgs:,} | {s.worker_lag:,} | "
              f"{lag_s:.1f} | {behind} | {cores:.2f} | {broker:.2f} | "
              f"{s.rss.get('worker', 0):,.0f} | {s.rss.get('tansu', 0):,.0f} |")
    t, lag = np.array(times), np.array(lags)
    rss = np.array([s.rss.get("worker", 0.0) for s in samples])
    # only while events were still being published: the drain after the end is no test
    done = t[int(np.argmax(np.array(published) >= published[-1]))]
    steady = (t >= min(60.0, done / 4)) & (t <= done)
    if steady.sum() >= 3:
        slope = float(np.polyfit(t[steady], lag[steady], 1)[0])
        grew = slope * (t[steady][-1] - t[steady][0])
        verdict = "flat" if grew < sim_step_s else "GROWS"
        print(f"\nLag trend from the first minute to the end of publishing (t={done:.0f} s): "
              f"{slope * 60:+.2f} simulated s per minute ({grew:+.1f} s; max "
              f"{lag[steady].max():.1f} s): **{verdict}** (flat: it grows by less than one step). "
              f"Drained {t[-1] - done:.0f} s after the last message was published.")
    # memory once the first minutes have filled the caches (the decoder's, the engine's)
    settled = (t >= min(300.0, done / 3)) & (t <= done) & (rss > 0)
    if settled.sum() >= 3:
        mb_per_s = float(np.polyfit(t[settled], rss[settled], 1)[0])
        first, span = float(rss[settled][0]), float(t[settled][-1] - t[settled][0])
        grew_mb = mb_per_s * span
        verdict = "flat" if grew_mb < 0.05 * first else "GROWS"
        print(f"\nWorker RSS trend from t={t[settled][0]:.0f} s to the end of publishing: "
              f"{mb_per_s * 60:+.2f} MB per minute ({grew_mb:+.0f} MB over {span / 60:.0f} "
              f"min, from {first:,.0f} MB; max {rss[settled].max():,.0f} MB): **{verdict}** "
              "(flat: it grows by less than 5%).")
