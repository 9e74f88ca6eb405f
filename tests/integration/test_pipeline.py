"""The whole stream path with the real broker (tansu), real workers and real chDB.

recording -> `flare replay` -> Kafka -> `flare worker` -> ClickHouse, API, incidents topic,
compared with `flare diagnose` on the same recording.
"""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest
from aiokafka.partitioner import murmur2

from flare.local.broker import TansuBroker
from flare.local.processes import flare_argv
from flare.offline import diagnose_messages, recording_messages
from producers.publisher import KafkaPublisher
from producers.recording import message_ts_ns
from producers.simulator import Fault, Scenario, layout_for_gpus, write_recording
from schemas.kafka import KafkaConnection
from schemas.topics import DEADLETTER, INCIDENTS, JOBS, STEPS, STEPS_V2
from schemas.wire import DeadLetterV1, IncidentV1
from storage.client import connect
from storage.reader import Queries
from streams.kafka.follow import Received, TopicFollower, read_until
from tests.integration.conftest import PARTITIONS, ROOT, WorkerProcess, unique, wait_for

pytestmark = pytest.mark.integration

COMPARED = ("id", "job", "status", "kind", "culprit", "onset_step", "opened_step",
            "opened_ts_ns", "last_step", "resolved_step", "evidence_steps", "summary")


def simulate(path: Path, job: str, *, gpus: int = 32, steps: int = 60, onset: int = 20,
             seed: int = 3, step_time_s: float = 0.5) -> Path:
    scenario = Scenario(job=job, layout=layout_for_gpus(gpus), steps=steps, seed=seed,
                        fault=Fault("slow_gpu", 1.5, onset, None), step_time_s=step_time_s)
    write_recording(scenario, path)
    return path


def offline(paths: Iterable[Path]) -> dict[str, IncidentV1]:
    out: dict[str, IncidentV1] = {}
    for p in paths:
        out.update(diagnose_messages(recording_messages(str(p))).incidents)
    return out


def replay(path: Path, bootstrap: str, **env: str) -> None:
    result = subprocess.run(flare_argv("replay", str(path), "--bootstrap", bootstrap), cwd=ROOT,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env} if env else None)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("published ")


def committed(conn: KafkaConnection, group: str, tps: Iterable[str]) -> dict[str, int]:
    """The group's committed offset of each "topic[partition]" (-1001: none)."""
    from confluent_kafka import Consumer, TopicPartition

    parsed = [(tp[: tp.rindex("[")], int(tp[tp.rindex("[") + 1 : -1])) for tp in tps]
    c = Consumer({"bootstrap.servers": conn.bootstrap, "group.id": group,
                  "enable.auto.commit": False})
    try:
        got = c.committed([TopicPartition(t, p) for t, p in parsed], timeout=20)
    finally:
        c.close()
    return {f"{x.topic}[{x.partition}]": x.offset for x in got}


def view(inc: Any) -> dict[str, Any]:
    """The fields every copy of an incident must agree on (floats compared separately)."""
    d = msgspec.to_builtins(inc) if isinstance(inc, IncidentV1) else dict(inc)
    return {k: d[k] for k in COMPARED}


def same(got: dict[str, Any], want: IncidentV1) -> bool:
    g = msgspec.to_builtins(got) if isinstance(got, IncidentV1) else got
    return (view(g) == view(want)
            and g["slowdown"] == pytest.approx(want.slowdown, rel=1e-6)
            and g["lost_gpu_seconds"] == pytest.approx(want.lost_gpu_seconds, rel=1e-6)
            and [s["entity"] for s in g["suspects"]] == [s.entity for s in want.suspects])


def final_incidents(msgs: list[Received], jobs: set[str]) -> dict[str, IncidentV1]:
    out: dict[str, IncidentV1] = {}
    for m in msgs:
        if m.key is not None and m.key.decode() in jobs:
            inc = msgspec.json.decode(m.value or b"", type=IncidentV1)
            out[inc.id] = inc
    return out


def incidents_from_topic(conn: KafkaConnection, want: dict[str, IncidentV1],
                         timeout_s: float = 90.0) -> dict[str, IncidentV1]:
    jobs = {i.job for i in want.values()}

    def done(msgs: list[Received]) -> bool:
        got = final_incidents(msgs, jobs)
        return got.keys() == want.keys() and all(same(msgspec.to_builtins(got[k]), want[k])
                                                 for k in want)

    with TopicFollower(conn, [INCIDENTS]) as f:
        return final_incidents(read_until(f, done, timeout_s=timeout_s), jobs)


def test_publisher_lands_a_job_where_java_clients_and_faust_would(broker: TansuBroker) -> None:
    jobs = [unique("part") for _ in range(12)]
    with KafkaPublisher(broker.connection) as pub:
        for job in jobs:
            pub.publish(JOBS, job, {"v": 1, "job": job, "event": "end", "ts_ns": 1})
    with TopicFollower(broker.connection, [JOBS]) as f:
        got = read_until(f, lambda ms: {m.key for m in ms} >= {j.encode() for j in jobs},
                         timeout_s=30)
    where = {m.key.decode(): m.partition for m in got if m.key and m.key.decode() in jobs}
    assert where == {j: (murmur2(j.encode()) & 0x7FFFFFFF) % PARTITIONS for j in jobs}


@pytest.mark.parametrize("encoding", ["v1", "v2"])
def test_a_recording_gives_the_same_incidents_in_clickhouse_the_api_and_the_topic(
        broker: TansuBroker, start_worker: Callable[..., WorkerProcess], tmp_path: Path,
        encoding: str) -> None:
    """Whichever encoding the producer sends its steps in (FLARE_STEPS_ENCODING), the worker
    finds what `flare diagnose` finds in the recording."""
    job = unique(f"e2e-{encoding}")
    rec = simulate(tmp_path / "run.jsonl", job)
    want = offline([rec])
    assert want, "the scenario must produce an incident"

    worker = start_worker(unique("g-e2e"))
    replay(rec, broker.bootstrap, FLARE_STEPS_ENCODING=encoding)

    on_topic = incidents_from_topic(broker.connection, want)
    assert on_topic.keys() == want.keys()
    assert all(same(msgspec.to_builtins(on_topic[k]), want[k]) for k in want)

    def api_has_them() -> bool:
        items = worker.get("/v1/incidents", job=job).json()["items"]
        return {i["id"]: i for i in items}.keys() == want.keys() and all(
            same(i, want[i["id"]]) for i in items)

    wait_for(api_has_them, 30, "the API to serve the incidents")
    stats = worker.stats()
    assert stats["storage_ok"] and stats["incident_events"] >= len(want)
    read = {tp[:tp.index("[")] for tp in stats["processed"]}  # (other tests' jobs too)
    assert (STEPS_V2 if encoding == "v2" else STEPS) in read, read

    assert worker.stop() == 0, worker.log()[-3000:]
    db = connect(f"chdb:///{worker.chdb_dir.as_posix().lstrip('/')}")
    try:
        stored = {r["id"]: r for r in Queries(db).incidents(job=job)}
        steps = db.rows(f"SELECT count() AS n FROM {db.table('job_steps')} FINAL "
                        "WHERE job = {job:String}", {"job": job})[0]["n"]
    finally:
        db.close()
    assert stored.keys() == want.keys()
    assert all(same(stored[k], want[k]) for k in want)
    assert steps == 60


def test_bad_messages_become_dead_letters_and_nothing_else_is_lost(
        broker: TansuBroker, start_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    job = unique("dl")
    rec = simulate(tmp_path / "ok.jsonl", job, gpus=8, steps=30, onset=10)
    worker = start_worker(unique("g-dl"), FLARE_MAX_MESSAGE_BYTES="65536")
    before = worker.stats()["dead_letters"]["by_cause"]

    bad_key = unique("dl-bad")
    good_step = orjson.loads(next(line for line in rec.read_bytes().splitlines()
                                  if b'"flare.steps.v1"' in line))["value"]
    bad = {
        "malformed": b"{this is not json",
        "truncated": orjson.dumps(good_step)[:200],
        "wrong version": orjson.dumps({**good_step, "v": 2}),
        "oversized": orjson.dumps({**good_step, "node": "n", "pad": "x" * 100_000}),
        "bad field": orjson.dumps({**good_step, "rank": -1}),
    }
    with KafkaPublisher(broker.connection) as pub:
        for raw in bad.values():
            pub.publish(STEPS, bad_key, raw)
    replay(rec, broker.bootstrap)

    def dead_letters(msgs: list[Received]) -> list[DeadLetterV1]:
        return [msgspec.json.decode(m.value or b"", type=DeadLetterV1) for m in msgs
                if m.key == bad_key.encode()]

    with TopicFollower(broker.connection, [DEADLETTER]) as f:
        got = dead_letters(read_until(f, lambda ms: len(dead_letters(ms)) >= len(bad),
                                      timeout_s=60))
    reasons = [d.reason for d in sorted(got, key=lambda d: d.offset)]
    assert len(reasons) == len(bad)
    assert "malformed" in reasons[0]
    assert "truncated" in reasons[1]
    assert reasons[2].startswith("$.v") and "accepts v=1" in reasons[2]
    assert "exceeds the 65536-byte limit" in reasons[3]
    assert reasons[4].startswith("$.rank")
    assert all(d.topic == STEPS for d in got)
    payloads = [base64.b64decode(d.payload_b64) for d in sorted(got, key=lambda d: d.offset)]
    assert payloads == list(bad.values())  # the original bytes, for whoever fixes the producer

    want = offline([rec])
    incidents_from_topic(broker.connection, want)  # the good job is still fully diagnosed

    def counted() -> bool:
        now = worker.stats()["dead_letters"]["by_cause"]
        return sum(now.values()) - sum(before.values()) >= len(bad)

    wait_for(counted, 30, "the dead-letter counters")
    assert worker.get("/readyz").status_code == 200 and worker.alive()

    assert worker.stop() == 0
    db = connect(f"chdb:///{worker.chdb_dir.as_posix().lstrip('/')}")
    try:
        n_steps = db.rows(f"SELECT count() AS n FROM {db.table('job_steps')} FINAL "
                          "WHERE job = {job:String}", {"job": job})[0]["n"]
        stored_dl = db.rows(f"SELECT reason FROM {db.table('dead_letters')} FINAL "
                            "WHERE topic = {t:String} ORDER BY offset", {"t": STEPS})
    finally:
        db.close()
    assert n_steps == 30  # every step of the good job made it
    assert sum(1 for r in stored_dl if r["reason"] in reasons) == len(bad)


def jobs_on_distinct_partitions(prefix: str, n: int) -> list[str]:
    """n job ids whose messages land on n different partitions (murmur2, like the producer)."""
    out: dict[int, str] = {}
    i = 0
    while len(out) < n:
        job = unique(f"{prefix}{i}")
        out.setdefault((murmur2(job.encode()) & 0x7FFFFFFF) % PARTITIONS, job)
        i += 1
    return [out[p] for p in sorted(out)]


def test_two_workers_in_one_group_split_the_jobs_and_each_diagnoses_its_own(
        broker: TansuBroker, start_workers: Callable[..., list[WorkerProcess]],
        tmp_path: Path) -> None:
    a, b = start_workers(unique("g-two"), "a", "b")

    def split() -> bool:
        pa = {t.split("[")[1] for t in a.stats()["assigned"]}
        pb = {t.split("[")[1] for t in b.stats()["assigned"]}
        return bool(pa) and bool(pb) and not (pa & pb) and len(pa | pb) == PARTITIONS

    wait_for(split, 60, "the group to split the partitions between both workers")

    jobs = jobs_on_distinct_partitions("two", PARTITIONS)
    recs = [simulate(tmp_path / f"{j}.jsonl", j, gpus=16, steps=40, onset=12, seed=i)
            for i, j in enumerate(jobs)]
    want = offline(recs)
    assert {i.job for i in want.values()} == set(jobs)
    for rec in recs:
        replay(rec, broker.bootstrap)

    on_topic = incidents_from_topic(broker.connection, want)
    assert on_topic.keys() == want.keys()

    def served(w: WorkerProcess) -> set[str]:
        return {i["job"] for j in jobs
                for i in w.get("/v1/incidents", job=j).json()["items"]}

    wait_for(lambda: served(a) | served(b) == set(jobs), 30, "both APIs to serve incidents")
    in_a, in_b = served(a), served(b)
    assert in_a and in_b and not (in_a & in_b), (in_a, in_b)
    for w in (a, b):
        for j in served(w):
            items = {i["id"]: i for i in w.get("/v1/incidents", job=j).json()["items"]}
            mine = {k: v for k, v in want.items() if v.job == j}
            assert items.keys() == mine.keys() and all(same(items[k], mine[k]) for k in mine)


def test_a_worker_taking_over_a_job_rebuilds_its_state_and_continues_the_incident(
        broker: TansuBroker, start_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    job = unique("takeover")
    rec = simulate(tmp_path / "run.jsonl", job)
    want = offline([rec])
    lines = rec.read_bytes().splitlines(keepends=True)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_bytes(b"".join(lines[: len(lines) * 2 // 3]))
    second.write_bytes(b"".join(lines[len(lines) * 2 // 3:]))
    group = unique("g-takeover")

    a = start_worker(group, "a")
    replay(first, broker.bootstrap)
    with TopicFollower(broker.connection, [INCIDENTS]) as f:  # a opened the incident
        opened = final_incidents(read_until(f, lambda ms: bool(final_incidents(ms, {job})),
                                            timeout_s=60), {job})
    assert opened.keys() == want.keys() and all(i.status == "open" for i in opened.values())
    def settled() -> bool:  # read everything, holds nothing for order, acked all it read
        s = a.stats()
        return s["total_lag"] == 0 and s["held_for_order"] == 0 and s["acked"] == s["processed"]

    wait_for(settled, 30, "worker a to catch up and ack what it read")
    processed = a.stats()["processed"]
    assert a.stop() == 0, a.log()[-3000:]  # commits what it processed
    assert committed(broker.connection, group, processed) == {
        tp: last + 1 for tp, last in processed.items()}  # acked once stored, then committed

    b = start_worker(group, "b")
    assert b.stats()["rebuilt_from_history"] > 0
    replay(second, broker.bootstrap)
    on_topic = incidents_from_topic(broker.connection, want)
    assert on_topic.keys() == want.keys()  # same ids: continued, not re-opened
    assert all(same(msgspec.to_builtins(on_topic[k]), want[k]) for k in want)


def test_a_worker_joining_mid_stream_changes_nothing_in_the_results(
        broker: TansuBroker, start_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    """A rebalance while jobs stream in real time: partitions move to the newcomer (which
    rebuilds their state from history), the others stay (re-delivered records skipped);
    every job's incidents are still exactly the offline ones."""
    jobs = jobs_on_distinct_partitions("mid", PARTITIONS)
    # 60 steps stream for about a minute: on a loaded machine the second worker took long
    # enough to start that 40 had all been sent before it joined (CI, 2026-11-29)
    recs = [simulate(tmp_path / f"{j}.jsonl", j, gpus=16, steps=60, onset=12, seed=i)
            for i, j in enumerate(jobs)]
    want = offline(recs)
    lines = [(message_ts_ns(orjson.loads(line)["value"], 0), line)
             for rec in recs for line in rec.read_bytes().splitlines(keepends=True)]
    merged = tmp_path / "all.jsonl"
    merged.write_bytes(b"".join(line for _ts, line in sorted(lines, key=lambda x: x[0])))

    group = unique("g-mid")
    a = start_worker(group, "a")
    player = subprocess.Popen(flare_argv("replay", str(merged), "--bootstrap", broker.bootstrap,
                                         "--speed", "1"), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: a.stats()["records"] > 500, 30, "worker a to be mid-stream")
        b = start_worker(group, "b")
        assert player.poll() is None, "the rebalance must happen while the jobs stream"
        assert player.wait(timeout=120) == 0, player.stdout.read() if player.stdout else ""
    finally:
        if player.poll() is None:
            player.kill()
    on_topic = incidents_from_topic(broker.connection, want)
    assert on_topic.keys() == want.keys()
    assert all(same(msgspec.to_builtins(on_topic[k]), want[k]) for k in want)
    assert b.stats()["assigned"], "b took some partitions"
    assert b.stats()["rebuilt_from_history"] > 0, "b rebuilt them from what a had read"
