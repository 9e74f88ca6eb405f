"""Bad input through the real broker (issue #16): a few hundred malformed messages of every
family (tests/unit/streams/test_malformed_fuzz.py) interleaved with a faulty job's messages,
published to tansu and consumed by a real `flare worker` (chDB inside).

Every malformed message comes back as exactly one dead letter (on the dead-letter topic and
in ClickHouse) at its own topic, partition and offset, with its bytes and a reason naming the
field the fuzz strategy broke; the worker's counters (/worker/stats and the
`flare_worker_dead_letters_total` metric) grow by exactly the expected causes and no more; the
worker stays up and ready; and the job's incidents are the ones of a run that never saw the
bad messages.

The test has a broker of its own: the other tests' workers read the shared broker's topics
from the start, and some count dead letters by their reason.
"""

from __future__ import annotations

import base64
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flare.local import processes
from flare.local.broker import TansuBroker, free_port, start_tansu
from flare.offline import diagnose_messages
from producers.publisher import producer_config
from schemas.decode import DEFAULT_MAX_BYTES
from schemas.topics import DEADLETTER
from schemas.wire import DeadLetterV1
from storage.client import connect
from streams.kafka.follow import Received, TopicFollower, read_until
from streams.kafka.topics import ensure_topics
from tests.integration.conftest import PARTITIONS, ROOT, WorkerProcess, unique, wait_for
from tests.integration.test_pipeline import incidents_from_topic, same
from tests.unit.streams.test_malformed_fuzz import (
    FAMILIES,
    Malformed,
    cause_in,
    draw_cases,
    expected_payload,
    good_messages,
    interleave,
    metric_samples,
    templates,
)

pytestmark = pytest.mark.integration

PER_FAMILY = 24  # messages of each family (the heavy ones: 2)
Coords = tuple[str, int, int]


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    with start_tansu(free_port(), log_path=tmp_path_factory.mktemp("tansu") / "tansu.log") as b:
        ensure_topics(b.connection, PARTITIONS)
        yield b


@pytest.fixture
def worker(own_broker: TansuBroker, tmp_path: Path) -> Iterator[WorkerProcess]:
    """One `flare worker` on that broker, with the default size limit (8 MiB)."""
    w = processes.start_worker(own_broker.connection, tmp_path, group=unique("g-fuzz"),
                               partitions=PARTITIONS, api_port=free_port(), cwd=ROOT)
    try:
        wait_for(w.ready, 90, "the worker to be ready")
        yield w
    finally:
        w.stop()


def publish(broker: TansuBroker, stream: list[tuple[str, bytes | None, bytes | None]]
            ) -> list[Coords]:
    """Publish records in order (null keys and values as such) and return where each landed."""
    from confluent_kafka import Producer

    where: list[Coords | None] = [None] * len(stream)
    errors: list[str] = []

    def delivered(i: int) -> Callable[[Any, Any], None]:
        def report(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(str(err))
            else:
                where[i] = (msg.topic(), msg.partition(), msg.offset())
        return report

    producer = Producer(producer_config(broker.connection))
    for i, (topic, key, value) in enumerate(stream):
        producer.produce(topic, value=value, key=key, on_delivery=delivered(i))
        producer.poll(0)
    assert producer.flush(60) == 0 and not errors, errors[:3]
    assert all(w is not None for w in where)
    return [w for w in where if w is not None]


def dead_letter_counts(worker: WorkerProcess) -> tuple[Counter[str], dict[str, float]]:
    """The worker's dead-letter counters, from its stats and from its metrics page."""
    stats = Counter(worker.stats()["dead_letters"]["by_cause"])
    page = metric_samples(worker.get("/metrics").text, "flare_worker_dead_letters_total")
    return stats, page


def test_malformed_messages_through_the_broker_are_dead_lettered_once_and_change_nothing(
        own_broker: TansuBroker, worker: WorkerProcess) -> None:
    broker = own_broker
    job = unique("fuzz")
    tpl = templates(job)
    cases: list[Malformed] = []
    for spec in FAMILIES:
        n = PER_FAMILY if spec.per_example > 1 else 2
        cases += draw_cases(spec, tpl, n, DEFAULT_MAX_BYTES)
    good = good_messages(job)
    want = diagnose_messages(good).incidents  # the run that never saw a bad message
    assert want, "the scenario must produce an incident"
    stream, positions = interleave(good, cases, job)

    assert dead_letter_counts(worker) == (Counter(), {})
    coords = publish(broker, stream)
    mine = {coords[i]: c for i, c in zip(positions, cases, strict=True)}
    causes = Counter(c.cause for c in cases)

    def my_dead_letters(msgs: list[Received]) -> list[DeadLetterV1]:
        dls = [msgspec.json.decode(m.value or b"", type=DeadLetterV1) for m in msgs]
        return [d for d in dls if (d.topic, d.partition, d.offset) in mine]

    with TopicFollower(broker.connection, [DEADLETTER]) as f:
        read_until(f, lambda ms: len(my_dead_letters(ms)) >= len(cases), timeout_s=120)
    on_topic = incidents_from_topic(broker.connection, want)  # the good job fully diagnosed
    assert on_topic.keys() == want.keys()
    assert all(same(msgspec.to_builtins(on_topic[k]), want[k]) for k in want)

    wait_for(lambda: worker.stats()["total_lag"] == 0, 60, "the worker to catch up")
    with TopicFollower(broker.connection, [DEADLETTER]) as f:  # all of them, once each
        got = my_dead_letters(read_until(f, lambda ms: False, timeout_s=5))
    assert sorted((d.topic, d.partition, d.offset) for d in got) == sorted(mine)
    for d in got:
        case = mine[(d.topic, d.partition, d.offset)]
        assert cause_in(d.reason) == case.cause, (d.reason, case)
        assert base64.b64decode(d.payload_b64) == expected_payload(case.value)

    stats, page = dead_letter_counts(worker)
    assert stats == causes and page == causes  # each counted once, under its cause
    assert worker.alive() and worker.get("/readyz").status_code == 200

    assert worker.stop() == 0, worker.log_tail()
    db = connect(f"chdb:///{worker.chdb_dir.as_posix().lstrip('/')}")
    try:
        rows = db.rows(f"SELECT topic, partition, offset, reason, payload_b64 FROM "
                       f"{db.table('dead_letters')} FINAL")
        steps = db.rows(f"SELECT count() AS n FROM {db.table('job_steps')} FINAL "
                        "WHERE job = {job:String}", {"job": job})[0]["n"]
    finally:
        db.close()
    stored = {(r["topic"], r["partition"], r["offset"]): r for r in rows
              if (r["topic"], r["partition"], r["offset"]) in mine}
    assert stored.keys() == mine.keys()
    assert all(cause_in(r["reason"]) == mine[k].cause for k, r in stored.items())
    assert steps == 30  # every step of the good job
