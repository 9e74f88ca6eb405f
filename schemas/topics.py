"""The Kafka topics of the wire contract (DESIGN §3, and issue #17's two stages): the one
home of their names.

Every producer, the worker, the tests and the benchmarks name topics through these constants;
topic creation and layout checks live with the Kafka utilities (`streams/kafka/topics.py`).
"""

from __future__ import annotations

STEPS = "flare.steps.v1"
# The same rank-steps as binary columns (`schemas.steps_v2`; issue #17): a producer sends each
# step on one of the two (`FLARE_STEPS_ENCODING`), the worker reads both.
STEPS_V2 = "flare.steps.v2"
HEARTBEATS = "flare.heartbeats.v1"
JOBS = "flare.jobs.v1"
INCIDENTS = "flare.incidents.v1"
DEADLETTER = "flare.deadletter.v1"
# A job split across workers (issue #17): its ranks' step messages (the `flare.steps.v1`
# value) keyed by `<job>/<shard>` for stage 1, and each shard's assembled step
# (`schemas.partial_frame`, binary) keyed by job for stage 2, the job's worker.
SHARD_STEPS = "flare.shardsteps.v1"
PARTIALS = "flare.partials.v1"

INPUT_TOPICS: tuple[str, ...] = (STEPS, STEPS_V2, HEARTBEATS, JOBS, PARTIALS)
# merged in event time (streams/ordering.py)
ORDERED_TOPICS: tuple[str, ...] = (STEPS, STEPS_V2, JOBS, PARTIALS)
OUTPUT_TOPICS: tuple[str, ...] = (INCIDENTS, DEADLETTER)
ALL_TOPICS: tuple[str, ...] = INPUT_TOPICS + OUTPUT_TOPICS  # keyed by job, co-partitioned
STAGE1_TOPICS: tuple[str, ...] = (SHARD_STEPS,)  # keyed by job and shard: a count of its own
CONSUMED_TOPICS: tuple[str, ...] = INPUT_TOPICS + STAGE1_TOPICS  # a dead letter's sources
