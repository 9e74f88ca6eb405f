"""Bad input at full scale through the real broker: every malformed message of the unit
fuzz test's families (10,000+, tests/unit/streams/test_malformed_fuzz.py; the same examples,
derandomized) interleaved with a faulty job's messages, published to a throwaway tansu and
consumed by one `flare worker` (embedded chDB), all on loopback.

Usage:
  python load-tests/fuzz_malformed.py [--scale 1.0] [--timeout-s 600]

`--scale` multiplies every family's count (0.1: a quick look). It checks, and exits 1
unless all hold:
- one dead letter per malformed message on the dead-letter topic and in ClickHouse (FINAL),
  at the message's own topic, partition and offset, under the cause the fuzzer expects;
- the worker's dead-letter counters (/worker/stats, `flare_worker_dead_letters_total`) grew
  by exactly those causes;
- the job's incidents are those of the offline diagnosis of its good messages alone;
- the worker is alive and ready at the end.
It prints a markdown section for RELIABILITY.md: the figures and how long each part took.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the fuzz strategies live with the tests

from flare.local.broker import free_port, start_tansu  # noqa: E402
from flare.local.processes import start_worker  # noqa: E402
from flare.offline import diagnose_messages  # noqa: E402
from schemas.decode import DEFAULT_MAX_BYTES  # noqa: E402
from schemas.topics import DEADLETTER  # noqa: E402
from schemas.wire import DeadLetterV1  # noqa: E402
from storage.client import connect  # noqa: E402
from streams.kafka.follow import TopicFollower, read_until  # noqa: E402
from streams.kafka.topics import ensure_topics  # noqa: E402
from tests.integration.test_malformed_broker import dead_letter_counts, publish  # noqa: E402
from tests.integration.test_pipeline import incidents_from_topic, same  # noqa: E402
from tests.unit.streams.test_malformed_fuzz import (  # noqa: E402
    FAMILIES,
    Malformed,
    cause_in,
    draw_cases,
    good_messages,
    interleave,
    templates,
)

PARTITIONS = 4


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies each family's count")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args()
    load0 = os.getloadavg()
    job = f"fuzz-{uuid.uuid4().hex[:8]}"

    g0 = time.perf_counter()
    tpl = templates(job)
    cases: list[Malformed] = []
    for spec in FAMILIES:
        cases += draw_cases(spec, tpl, max(1, round(spec.quota * args.scale)), DEFAULT_MAX_BYTES)
    good = good_messages(job)
    want = diagnose_messages(good).incidents
    stream, positions = interleave(good, cases, job)
    gen_s = time.perf_counter() - g0
    causes = Counter(c.cause for c in cases)
    print(f"generated {len(cases):,} malformed messages in {gen_s:.1f} s", file=sys.stderr)

    checks: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="flare-fuzz-") as tmpdir:
        tmp = Path(tmpdir)
        broker = start_tansu(free_port(), log_path=tmp / "tansu.log")
        worker = None
        try:
            ensure_topics(broker.connection, PARTITIONS)
            worker = start_worker(broker.connection, tmp, group=f"fuzz-{uuid.uuid4().hex[:6]}",
                                  partitions=PARTITIONS, api_port=free_port(), cwd=ROOT)
            worker.wait_ready(120.0)
            before, before_page = dead_letter_counts(worker)
            t0 = time.monotonic()
            coords = publish(broker, stream)
            publish_s = time.monotonic() - t0
            mine = {coords[i]: c for i, c in zip(positions, cases, strict=True)}

            counted_s = None
            while time.monotonic() - t0 < args.timeout_s:
                now, _ = dead_letter_counts(worker)
                if sum((now - before).values()) >= len(cases):
                    counted_s = time.monotonic() - t0
                    break
                if not worker.alive():
                    break
                time.sleep(0.5)
            on_topic = incidents_from_topic(broker.connection, want, timeout_s=120)
            incidents_s = time.monotonic() - t0
            checks["incidents equal the clean run's"] = (
                on_topic.keys() == want.keys()
                and all(same(msgspec.to_builtins(on_topic[k]), want[k]) for k in want))

            with TopicFollower(broker.connection, [DEADLETTER]) as f:
                got = [d for d in (msgspec.json.decode(m.value or b"", type=DeadLetterV1)
                                   for m in read_until(f, lambda ms: False, timeout_s=15))
                       if (d.topic, d.partition, d.offset) in mine]
            checks["one dead letter each on the topic"] = (
                sorted((d.topic, d.partition, d.offset) for d in got) == sorted(mine))
            checks["every reason names the broken field"] = all(
                cause_in(d.reason) == mine[(d.topic, d.partition, d.offset)].cause for d in got)
            after, after_page = dead_letter_counts(worker)
            checks["stats counters exact"] = after - before == causes
            checks["metric counters exact"] = {
                k: v - before_page.get(k, 0) for k, v in after_page.items()
                if v != before_page.get(k, 0)} == causes
            checks["worker alive and ready"] = (worker.alive()
                                                and worker.get("/readyz").status_code == 200)
            rss = _rss_mb(worker.process.pid)
            checks["worker stopped cleanly"] = worker.stop(60.0) == 0
            db = connect(f"chdb:///{worker.chdb_dir.as_posix().lstrip('/')}")
            try:
                rows = db.rows(f"SELECT topic, partition, offset, reason FROM "
                               f"{db.table('dead_letters')} FINAL")
            finally:
                db.close()
            stored = {(r["topic"], r["partition"], r["offset"]): r["reason"] for r in rows}
            checks["one dead letter each in ClickHouse"] = all(
                k in stored and cause_in(stored[k]) == c.cause for k, c in mine.items())
        finally:
            if worker is not None and worker.alive():
                worker.stop(60.0)
            broker.stop()

    load1 = os.getloadavg()
    big = sum(1 for c in cases if c.value is not None and len(c.value) > DEFAULT_MAX_BYTES)
    families = Counter(c.family for c in cases)
    print("\n### Malformed input through the broker (load-tests/fuzz_malformed.py)\n")
    command = shlex.join(["python", f"load-tests/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    print(f"- command: `{command}`")
    print(f"- machine: {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python "
          f"{platform.python_version()}; load average before {load0[0]:.2f}, after "
          f"{load1[0]:.2f}")
    print(f"- input: {len(cases):,} malformed messages ({big} over the 8 MiB limit), "
          f"{len(good)} good ones of one 8-GPU job with a slow GPU, interleaved; "
          f"{len(families)} families, {len(causes)} distinct causes; generation {gen_s:.1f} s")
    print(f"- publish {publish_s:.1f} s; all dead letters counted "
          f"{'never' if counted_s is None else f'{counted_s:.1f} s'} after the first publish; "
          f"incidents complete {incidents_s:.1f} s after; worker RSS at the end {rss:.0f} MB\n")
    print("| check | result |\n|---|---|")
    for name, ok in checks.items():
        print(f"| {name} | {'yes' if ok else 'NO'} |")
    print("\n| family | messages | distinct causes |\n|---|---:|---:|")
    for family, n in families.items():
        print(f"| {family} | {n:,} | {len({c.cause for c in cases if c.family == family})} |")
    return 0 if all(checks.values()) else 1


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


if __name__ == "__main__":
    sys.exit(main())
