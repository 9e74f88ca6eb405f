"""The worker's per-record path without Kafka: batches in, rows and messages out.

The key property: however the consumer interleaves a job's three topics (a lagging worker
gets whole fetches of one topic before another), the worker's incidents are the ones
`flare diagnose` finds reading the recording in order.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest

from detectors.diagnoser import JobDiagnoser
from flare.offline import diagnose_messages
from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus
from schemas.steps_v2 import encode_steps_value
from schemas.testing import FakeClock
from schemas.topics import (
    DEADLETTER,
    HEARTBEATS,
    INCIDENTS,
    INPUT_TOPICS,
    JOBS,
    STEPS,
    STEPS_V2,
)
from schemas.wire import DeadLetterV1, IncidentV1
from storage.testing import MemoryStore
from streams.ordering import EventTimeMerger
from streams.pipeline import BATCH_MAX, Pipeline, Record, build_pipeline


def make_pipeline(sink: MemoryStore, clock: FakeClock) -> Pipeline:
    return build_pipeline(sink, lambda job: JobDiagnoser(job), max_message_bytes=1 << 20,
                          stall_after_s=30.0, job_idle_s=3600.0, now_s=clock.seconds)


class CountingMerger(EventTimeMerger[Any]):
    """The pipeline's merge, counting the most records one release handed over."""

    most = 0

    def release(self, has_more: Any, limit: int | None = None) -> list[Any]:
        out = super().release(has_more, limit)
        self.most = max(self.most, len(out))
        return out


@pytest.fixture(scope="module")
def recording() -> list[tuple[str, str, bytes]]:
    scenario = Scenario(job="pipe-32", layout=layout_for_gpus(32), steps=60, seed=3,
                        fault=Fault("slow_gpu", 1.5, 20, None), step_time_s=0.5)
    return [(topic, key, orjson.dumps(value))
            for topic, key, value, _ts in ClusterSimulator(scenario).events()]


def as_records(recording: list[tuple[str, str, bytes]], partition: int = 0) -> dict[str, list]:
    """Per topic, the records a consumer would get (offsets in publish order)."""
    per_topic: dict[str, list[Record]] = defaultdict(list)
    for topic, key, raw in recording:
        n = len(per_topic[topic])
        per_topic[topic].append(Record(topic, partition, n, key.encode(), raw, ref=(topic, n)))
    return per_topic


def interleaved(per_topic: dict[str, list[Record]], sizes: dict[str, int]) -> list[list[Record]]:
    """Batches as a lagging consumer sees them: whole chunks of one topic, round robin,
    the job's `end` event first of all."""
    order = (JOBS, HEARTBEATS, STEPS, STEPS_V2)
    iters = {t: iter(per_topic.get(t, [])) for t in order}
    batches: list[list[Record]] = []
    while True:
        progressed = False
        for t in order:
            chunk = list(itertools.islice(iters[t], sizes.get(t, sizes.get(STEPS, 1))))
            if chunk:
                batches.append(chunk)
                progressed = True
        if not progressed:
            return batches


def final_states(messages: list[bytes]) -> dict[str, IncidentV1]:
    out: dict[str, IncidentV1] = {}
    for raw in messages:
        inc = msgspec.json.decode(raw, type=IncidentV1)
        out[inc.id] = inc
    return out


@pytest.mark.parametrize("encoding", ["v1", "v2"])
@pytest.mark.parametrize("release_max", [BATCH_MAX, 40])
def test_worker_incidents_equal_offline_diagnosis_whatever_the_interleaving(
        recording: list[tuple[str, str, bytes]], release_max: int, encoding: str) -> None:
    """With the worker's bound on what one call releases, too: what a call leaves held is
    released by the calls after it (`on_held`, as the worker loops), in the same order. The
    steps as v2 (`flare.steps.v2`) give what the v1 recording gives offline."""
    offline = diagnose_messages((t, raw) for t, _k, raw in recording)
    assert offline.incidents, "the scenario must produce an incident to compare"
    if encoding == "v2":
        recording = [(STEPS_V2, k, encode_steps_value(orjson.loads(raw))) if t == STEPS
                     else (t, k, raw) for t, k, raw in recording]

    sink, clock = MemoryStore(), FakeClock()
    pipe = make_pipeline(sink, clock)
    pipe.merger = merger = CountingMerger(pipe.merger.topics, clock.seconds)
    per_topic = as_records(recording)
    pipe.on_assigned([(t, 0) for t in INPUT_TOPICS])
    for t, recs in per_topic.items():  # what fetch responses tell: the high watermarks
        pipe.progress.set_highwater(t, 0, len(recs))
    published: list[bytes] = []
    held: set[Any] = set()
    for batch in interleaved(per_topic, {JOBS: 10, HEARTBEATS: 700, STEPS: 300}):
        result = pipe.on_records(batch, release_max)
        assert pipe.flush()
        held |= set(result.held)
        held -= set(result.finished)
        published += [o.value for o in result.outgoing if o.topic == INCIDENTS]
        while (more := pipe.on_held(release_max)).finished:
            held -= set(more.finished)
            published += [o.value for o in more.outgoing if o.topic == INCIDENTS]
    for _ in range(2):  # the first releases what the merge held (the job's end among it);
        # a minute later, that end is final (its grace is over)
        for tail in pipe.ticks(release_max):
            published += [o.value for o in tail.outgoing if o.topic == INCIDENTS]
            held -= set(tail.finished)
        while (more := pipe.on_held(release_max)).finished:
            held -= set(more.finished)
            published += [o.value for o in more.outgoing if o.topic == INCIDENTS]
        clock.advance(60)
    assert pipe.flush()

    assert held == set(), "every held record was processed in the end"
    assert final_states(published) == offline.incidents
    stored = {i.id: i for i in sink.stored if isinstance(i, IncidentV1)}
    assert stored == offline.incidents
    assert pipe.merger.forced == 0
    assert merger.most <= release_max
    if release_max < BATCH_MAX:
        assert merger.most == release_max, "the interleaving must make a call hit the bound"


def test_dead_letters_are_stored_and_published_keyed_by_job() -> None:
    sink, clock = MemoryStore(), FakeClock()
    pipe = make_pipeline(sink, clock)
    result = pipe.on_records([
        Record(STEPS, 2, 7, b"job-x", b'{"v":3}'),
        Record(HEARTBEATS, 2, 8, None, b"nope"),
    ])
    assert pipe.flush()
    assert [o.topic for o in result.outgoing] == [DEADLETTER, DEADLETTER]
    assert result.outgoing[0].key == b"job-x"
    dl = msgspec.json.decode(result.outgoing[0].value, type=DeadLetterV1)
    assert (dl.topic, dl.partition, dl.offset) == (STEPS, 2, 7) and dl.reason.startswith("$.v")
    assert [type(x) for x in sink.stored] == [DeadLetterV1, DeadLetterV1]
    assert pipe.snapshot()["dead_letters"] == {
        "total": 2, "by_topic": {STEPS: 1, HEARTBEATS: 1}, "by_cause": {"$.v": 1, "$": 1}}


def test_records_of_partitions_no_longer_ours_are_skipped() -> None:
    sink, clock = MemoryStore(), FakeClock()
    pipe = make_pipeline(sink, clock)
    pipe.on_assigned([(STEPS, 0)])
    result = pipe.on_records([Record(STEPS, 1, 0, b"j", b"{}")])
    assert result.outgoing == [] and pipe.stats.skipped_not_assigned == 1


def test_storage_failure_keeps_rows_and_fails_readiness_until_it_recovers() -> None:
    sink, clock = MemoryStore(), FakeClock()
    pipe = make_pipeline(sink, clock)
    pipe.on_assigned([(STEPS, 0)])
    pipe.on_records([Record(STEPS, 0, 0, b"j", b"bad")])
    sink.fail = True
    assert not pipe.flush()
    r = pipe.readiness()
    assert not r.ready and r.reason.startswith("storage:") and "set to fail" in r.reason
    assert len(sink.buffered) == 1 and sink.stored == []
    sink.fail = False
    assert pipe.flush()
    assert pipe.readiness().ready and len(sink.stored) == 1


def test_sim_fixture_is_small(recording: list[tuple[str, str, bytes]], tmp_path: Path) -> None:
    # Keeps this unit tier fast: if the simulator's output grows, shrink the scenario.
    assert len(recording) < 10_000


def run_live(pipe: Pipeline, batches: list[list[Record]], clock: FakeClock | None = None
             ) -> list[bytes]:
    """Feed the batches and tick; with `clock`, let a minute pass and tick again: a job's
    end is final after a grace, as the offline diagnosis's end of input makes it at once."""
    published: list[bytes] = []
    for batch in batches:
        result = pipe.on_records(batch)
        assert pipe.flush()
        published += [o.value for o in result.outgoing if o.topic == INCIDENTS]
    published += [o.value for part in pipe.ticks() for o in part.outgoing
                  if o.topic == INCIDENTS]
    if clock is not None:
        clock.advance(60)
        published += [o.value for part in pipe.ticks() for o in part.outgoing
                      if o.topic == INCIDENTS]
    return published


def assigned_with_highwaters(pipe: Pipeline, per_topic: dict[str, list[Record]]) -> set[int]:
    new = pipe.on_assigned([(t, 0) for t in INPUT_TOPICS])
    for t, recs in per_topic.items():
        pipe.progress.set_highwater(t, 0, len(recs))
    return new


def test_a_new_owner_rebuilt_from_history_continues_the_same_incidents(
        recording: list[tuple[str, str, bytes]]) -> None:
    offline = diagnose_messages((t, raw) for t, _k, raw in recording)
    per_topic = as_records(recording)
    # The previous owner committed everything up to the middle of the run.
    cut = {t: len(recs) // 2 for t, recs in per_topic.items()}
    history = [r for t, recs in per_topic.items() for r in recs[:cut[t]]]
    live = {t: recs[cut[t]:] for t, recs in per_topic.items()}

    sink, clock = MemoryStore(), FakeClock()
    pipe = make_pipeline(sink, clock)
    assert assigned_with_highwaters(pipe, per_topic) == {0}
    assert pipe.rebuild(history) == len(history)
    assert sink.buffered == [] and pipe.router.dead_letters.total == 0  # nothing re-emitted
    published = run_live(pipe, interleaved(live, {JOBS: 10, HEARTBEATS: 500, STEPS: 200}),
                         clock)

    got = final_states(published)
    assert got == offline.incidents  # same ids: the incident continued, not re-opened


def test_after_a_rebalance_redelivered_records_are_skipped_and_held_ones_processed(
        recording: list[tuple[str, str, bytes]]) -> None:
    offline = diagnose_messages((t, raw) for t, _k, raw in recording)
    per_topic = as_records(recording)
    sink, clock = MemoryStore(), FakeClock()
    pipe = make_pipeline(sink, clock)
    assigned_with_highwaters(pipe, per_topic)
    batches = interleaved(per_topic, {JOBS: 10, HEARTBEATS: 400, STEPS: 250})
    half = len(batches) // 2
    published = run_live(pipe, batches[:half])
    assert pipe.merger.buffered > 0, "the cut must leave records held by the merge"

    # Rebalance: everything revoked, the same partition comes back, and the consumer
    # re-delivers from its last commit (here: from the very beginning).
    pipe.on_revoked([(t, 0) for t in INPUT_TOPICS])
    assert pipe.merger.buffered == 0
    assert pipe.on_assigned([(t, 0) for t in INPUT_TOPICS]) == set()  # not new: state kept
    before = pipe.stats.records
    published += run_live(pipe, interleaved(per_topic, {JOBS: 10, HEARTBEATS: 400, STEPS: 250}),
                          clock)

    assert pipe.stats.skipped_redelivered > 0
    assert pipe.stats.records - before == sum(len(r) for r in per_topic.values()) \
        - pipe.stats.skipped_redelivered
    assert final_states(published) == offline.incidents
