"""The Kafka topics of the wire contract (DESIGN §3): the one home of their names.

Every producer, the worker, the tests and the benchmarks name topics through these constants;
topic creation and layout checks live with the Kafka utilities (`streams/kafka/topics.py`).
"""

from __future__ import annotations

STEPS = "flare.steps.v1"
HEARTBEATS = "flare.heartbeats.v1"
JOBS = "flare.jobs.v1"
INCIDENTS = "flare.incidents.v1"
DEADLETTER = "flare.deadletter.v1"

INPUT_TOPICS: tuple[str, ...] = (STEPS, HEARTBEATS, JOBS)
ORDERED_TOPICS: tuple[str, ...] = (STEPS, JOBS)  # merged in event time (streams/ordering.py)
OUTPUT_TOPICS: tuple[str, ...] = (INCIDENTS, DEADLETTER)
ALL_TOPICS: tuple[str, ...] = INPUT_TOPICS + OUTPUT_TOPICS
