"""A job split across workers (issue #17), through the real broker and real processes.

recording -> `flare replay` (FLARE_SHARD_RANKS) -> flare.shardsteps.v1 -> two `flare
shard-worker`s -> flare.partials.v1 -> `flare worker` -> incidents topic, compared with
`flare diagnose` of the same recording in one process.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from flare.local import processes
from flare.local.broker import TansuBroker
from flare.local.processes import Child, flare_argv
from schemas.topics import PARTIALS, STAGE1_TOPICS, STEPS
from streams.kafka.topics import ensure_topics
from tests.integration.conftest import PARTITIONS, ROOT, WorkerProcess, unique, wait_for
from tests.integration.test_pipeline import incidents_from_topic, offline, same, simulate, view

pytestmark = pytest.mark.integration

SHARD_RANKS = 8
SHARD_PARTITIONS = 4


def _assigned(child: Child) -> bool:
    """The stage-1 worker's last word on its partitions gives it some."""
    lines = [ln for ln in child.log().splitlines() if "partitions" in ln]
    return bool(lines) and not lines[-1].rstrip().endswith("[]")


def _count(log: str, what: str) -> int:
    line = [ln for ln in log.splitlines() if ln.startswith("flare shard-worker: read ")][-1]
    words = line.replace(",", "").split()
    return int(words[words.index(what) - 1])


def test_two_shard_workers_and_a_job_worker_give_the_incidents_of_one_process(
        broker: TansuBroker, start_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    # 4 shards on 4 partitions, one each (the producer places them): whatever the job id,
    # each of the two workers the group's assignor gives two partitions reads two shards
    job = unique("split")
    # 2 s steps replayed 16 times as fast: a step's grace (half a step) is 1 s of the worker's
    # clock, so a producer or a stage-1 worker held up on a loaded machine for less than that
    # loses no rank (with 0.5 s steps a 0.25 s pause read a rank as missing)
    rec = simulate(tmp_path / "run.jsonl", job, gpus=32, steps=50, step_time_s=2.0)
    want = offline([rec])
    assert any(i.kind != "job" for i in want.values()), "the scenario must find its fault"
    ensure_topics(broker.connection, SHARD_PARTITIONS, topics=STAGE1_TOPICS)

    worker = start_worker(unique("g-split"))
    group = unique("g-shards")
    shards = [processes.start_shard_worker(
        broker.connection, tmp_path, name=f"shard-{n}", group=group, shard_ranks=SHARD_RANKS,
        partitions=PARTITIONS, shard_partitions=SHARD_PARTITIONS, cwd=ROOT,
        extra_env={"FLARE_SHARD_ALIVE_FILE": str(tmp_path / f"alive-{n}")}) for n in "ab"]
    try:
        wait_for(lambda: all(_assigned(s) for s in shards), 60,
                 "both stage-1 workers to hold partitions")
        env = {**processes.with_kafka(os.environ, broker.connection),
               "FLARE_SHARD_RANKS": str(SHARD_RANKS),
               "FLARE_SHARD_PARTITIONS": str(SHARD_PARTITIONS)}
        # paced (the recording's 100 s in about 6 s): stage-1 workers drain a backlog at their
        # own rates, and one further behind than the job's worker holds steps for reads its
        # shards' ranks as missing (detectors/shard_merge.py, MAX_PENDING)
        result = subprocess.run(flare_argv("replay", str(rec), "--speed", "16"), cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr

        on_topic = incidents_from_topic(broker.connection, want)
        assert on_topic.keys() == want.keys()
        assert all(same(on_topic[k], want[k]) for k in want), [
            {f: (a, b) for f, a in view(on_topic[k]).items() if a != (b := view(want[k])[f])}
            for k in want]
        processed = worker.stats()["processed"]
        assert any(tp.startswith(PARTIALS) for tp in processed), processed
        assert not any(tp.startswith(STEPS) for tp in processed), "every step message is split"
    finally:
        for s in shards:  # signal both, then wait: a second SIGTERM while one is already
            s.process.terminate()  # exiting would land after Python dropped its handler
        codes = [s.process.wait(timeout=60) for s in shards]
    logs = [s.log() for s in shards]
    assert codes == [0, 0], logs
    assert all(_count(log, "records") > 0 for log in logs), f"both read shards: {logs}"
    assert all((tmp_path / f"alive-{n}").is_file() for n in "ab"), "the loops beat"
    assert sum(_count(log, "dead") for log in logs) == 0
    assert worker.alive()


def test_a_producer_refuses_a_shard_topic_whose_count_it_does_not_place_by(
        broker: TansuBroker, tmp_path: Path) -> None:
    """Shards are placed by FLARE_SHARD_PARTITIONS: a topic with another count would idle
    partitions or refuse shards placed past its end, so `flare replay` says so and exits 2."""
    ensure_topics(broker.connection, SHARD_PARTITIONS, topics=STAGE1_TOPICS)
    rec = simulate(tmp_path / "run.jsonl", unique("split-count"), gpus=8, steps=30)
    env = {**processes.with_kafka(os.environ, broker.connection),
           "FLARE_SHARD_RANKS": str(SHARD_RANKS),
           "FLARE_SHARD_PARTITIONS": str(2 * SHARD_PARTITIONS)}
    result = subprocess.run(flare_argv("replay", str(rec)), cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: flare.shardsteps.v1 has {SHARD_PARTITIONS} partitions but "
        f"FLARE_SHARD_PARTITIONS is {2 * SHARD_PARTITIONS}: producers place a job's shards "
        "by that setting, so it must be the topic's count"]
