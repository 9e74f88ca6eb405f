"""Reliability: kill -9 of the worker at a random point of a replayed job, then a restart.

Usage:
  python load-tests/reliability_kill.py [--runs 20] [--gpus 32] [--steps 80] [--speed 4]
      [--seed 0] [--fault slow_gpu] [--json out.json]

What runs, per run, all on loopback: a fresh tansu broker, a `flare worker` on a fresh chDB
directory, and `flare replay` of one simulated job with one fault, paced (`--speed`) so the
job streams in for a while. At a uniformly random point of the replay the worker gets
SIGKILL (no flush, no commit, no leaving its group); a new worker is started at once on the
same chDB directory and consumer group, as a supervisor would. When the replay is done and
the worker has caught up (lag 0, stored steps stable), it is stopped with SIGTERM and its
ClickHouse tables are read back.

The first run is the reference: the same job replayed with no kill. Every run must then have:
- for every table, exactly the reference's row count for the job after FINAL (at-least-once
  delivery plus deterministic keys in ReplacingMergeTree: a replayed row replaces itself);
- the same incident set: same ids, same kind, culprit, onset, status and evidence steps, no
  missed or extra incident.

A fresh broker per run keeps the job id (and so every deterministic id) the same in every
run. Prints a markdown table and a verdict; exit 1 when any run differs. This is a script
in load-tests/ (not the test suite) because 20 runs take several minutes; RELIABILITY.md has
its figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from flare.local.broker import free_port, start_tansu
from flare.local.processes import WorkerProcess, flare_argv, start_worker
from producers.simulator import Fault, Scenario, layout_for_gpus, write_recording
from storage.client import connect
from storage.reader import Queries
from storage.tables import TABLES
from streams.kafka.topics import ensure_topics

ROOT = Path(__file__).resolve().parents[1]
PARTITIONS = 4
JOB = "reliability-kill"
GROUP = "g-reliability"
# What must agree between runs; costs are floats of the same arithmetic on the same steps.
INCIDENT_FIELDS = ("id", "status", "kind", "culprit", "onset_step", "opened_step",
                   "resolved_step", "evidence_steps")


@dataclass
class Run:
    index: int
    killed_at_s: float | None  # seconds into the replay; None: the reference run
    counts: dict[str, int] = field(default_factory=dict)
    incidents: dict[str, dict[str, Any]] = field(default_factory=dict)
    records_before_kill: int = 0
    rebuilt: int = 0
    wall_s: float = 0.0
    error: str = ""


def simulate(path: Path, gpus: int, steps: int, seed: int, fault: str, job: str = JOB
             ) -> Path:
    scenario = Scenario(job=job, layout=layout_for_gpus(gpus), steps=steps, seed=seed,
                        fault=Fault(fault, 1.5, steps // 3, None), step_time_s=0.5)
    write_recording(scenario, path)
    return path


def wait_for(what: str, predicate: Any, timeout_s: float, interval_s: float = 0.25) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def stored_steps(worker: WorkerProcess) -> int:
    try:
        return int(worker.get("/v1/jobs/" + JOB).json().get("last_step") or -1)
    except Exception:
        return -2


def open_incidents(worker: WorkerProcess) -> int:
    """The job's open incidents as the API reads them (-1: no answer)."""
    try:
        return int(worker.get("/v1/jobs/" + JOB).json().get("open_incidents", -1))
    except Exception:
        return -1


def settle(worker: WorkerProcess, timeout_s: float) -> None:
    """Until the worker has read everything, its stored view stops moving, and the job's end
    has resolved its incidents. The end is final one grace period after the `end` event, on a
    tick of the worker's clock; a worker stopped before that tick stores the incident still
    open, so without this wait a run's stored status would depend on how fast it settled."""
    last: list[Any] = [None, time.monotonic()]

    def quiet() -> bool:
        s = worker.stats()
        now = (s["total_lag"], s["records"], stored_steps(worker))
        if now != last[0]:
            last[0], last[1] = now, time.monotonic()
            return False
        return s["total_lag"] == 0 and time.monotonic() - last[1] > 3.0

    try:
        wait_for("the worker to settle", quiet, timeout_s, 0.5)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; last (lag, records, stored step): {last[0]}") from None
    wait_for("the job's end to resolve its incidents", lambda: open_incidents(worker) == 0,
             120, 0.5)


def replay_whole(rec: Path, bootstrap: str) -> None:
    """Publish a recording as fast as the broker takes it."""
    done = subprocess.run(flare_argv("replay", str(rec), "--bootstrap", bootstrap), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"replay failed: {done.stderr[-500:]}")


def read_back(chdb_dir: Path, job: str = JOB
              ) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
    db = connect(f"chdb:///{chdb_dir.as_posix().lstrip('/')}")
    try:
        counts = {}
        for table in TABLES:
            if "job" not in {c.name for c in table.columns}:
                continue
            counts[table.name] = int(db.rows(  # every table is a ReplacingMergeTree
                f"SELECT count() AS n FROM {db.table(table.name)} FINAL "
                "WHERE job = {job:String}", {"job": job})[0]["n"])
        incidents = {r["id"]: {k: r[k] for k in INCIDENT_FIELDS}
                     for r in Queries(db).incidents(job=job, limit=1000)}
    finally:
        db.close()
    return counts, incidents


def one_run(index: int, rec: Path, speed: float, replay_s: float, kill: bool,
            rng: random.Random, workdir: Path) -> Run:
    run = Run(index, None)
    t0 = time.monotonic()
    work = workdir / f"run-{index}"
    work.mkdir()
    with start_tansu(free_port(), log_path=work / "tansu.log") as broker:
        ensure_topics(broker.connection, PARTITIONS)

        def worker() -> WorkerProcess:  # the same name: the same chDB directory
            w = start_worker(broker.connection, work, name="w", group=GROUP,
                             partitions=PARTITIONS, api_port=free_port(), cwd=ROOT)
            w.wait_ready(120)
            return w

        w = worker()
        player = subprocess.Popen(
            flare_argv("replay", str(rec), "--bootstrap", broker.bootstrap, "--speed",
                       str(speed)), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            if kill:
                at = rng.uniform(0.05, 0.95) * replay_s
                time.sleep(at)
                run.killed_at_s = round(at, 2)
                run.records_before_kill = int(w.stats()["records"])
                w.process.kill()  # SIGKILL: no flush, no commit
                w.process.wait()
                w = worker()
                run.rebuilt = int(w.stats()["rebuilt_from_history"])
            out, _ = player.communicate(timeout=replay_s * 4 + 120)
            if player.returncode != 0:
                raise RuntimeError(f"replay failed: {out.decode(errors='replace')[-500:]}")
            settle(w, 300)
        finally:
            if player.poll() is None:
                player.kill()
        code = w.stop(60)
        if code != 0:
            raise RuntimeError(f"the worker exited with {code}:\n{w.log_tail()}")
        run.counts, run.incidents = read_back(w.chdb_dir)
    run.wall_s = round(time.monotonic() - t0, 1)
    return run


def machine() -> str:
    cpus = os.cpu_count()
    return (f"{platform.machine()}, {cpus} cores, Python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.2f} at the end")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="runs with a kill (plus a reference)")
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--speed", type=float, default=4.0, help="replay pace (x real time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault", default="slow_gpu")
    ap.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="flare-kill-"))
    try:
        rec = simulate(workdir / "run.jsonl", args.gpus, args.steps, args.seed, args.fault)
        replay_s = args.steps * 0.5 / args.speed
        runs = [one_run(0, rec, args.speed, replay_s, False, rng, workdir)]
        ref = runs[0]
        if not ref.incidents:
            print("the reference run opened no incident: pick another fault or seed")
            return 2
        for i in range(1, args.runs + 1):
            try:
                runs.append(one_run(i, rec, args.speed, replay_s, True, rng, workdir))
            except Exception as exc:  # a run that fails is reported, not hidden
                runs.append(Run(i, None, error=f"{type(exc).__name__}: {exc}"[:300]))
            r = runs[-1]
            print(f"run {i}: killed at {r.killed_at_s} s, {r.wall_s} s, "
                  f"{'same' if same(r, ref) else 'DIFFERENT'} {r.error}", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"`python load-tests/reliability_kill.py {' '.join(argv or sys.argv[1:])}`\n")
    print(f"{machine()}; job: {args.gpus} GPUs, {args.steps} steps of 0.5 s, fault "
          f"{args.fault}, replayed at {args.speed}x ({replay_s:.0f} s)\n")
    print("| run | killed at (s) | records read before | rebuilt from history | rows equal | "
          "incidents equal | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        kill = "reference" if r.index == 0 else (r.killed_at_s if not r.error else "failed")
        print(f"| {r.index} | {kill} | {r.records_before_kill} | {r.rebuilt} | "
              f"{r.counts == ref.counts} | {r.incidents == ref.incidents} | {r.wall_s} |")
    bad = [r for r in runs[1:] if not same(r, ref)]
    print(f"\nreference rows: {ref.counts}; incidents: "
          f"{[(i['kind'], i['culprit'], i['status']) for i in ref.incidents.values()]}")
    print(f"\n{len(runs) - 1 - len(bad)} of {len(runs) - 1} killed runs equal the reference")
    for r in bad:
        print(f"- run {r.index}: {r.error or ''} rows {r.counts}; incidents "
              f"{sorted(r.incidents)} vs {sorted(ref.incidents)}")
    if args.json is not None:
        args.json.write_bytes(orjson.dumps([r.__dict__ for r in runs],
                                           option=orjson.OPT_INDENT_2))
    return 1 if bad else 0


def same(run: Run, ref: Run) -> bool:
    return not run.error and run.counts == ref.counts and run.incidents == ref.incidents


if __name__ == "__main__":
    sys.exit(main())
