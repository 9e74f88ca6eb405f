"""Offline diagnosis of a recorded stream: the worker's code path without Kafka.

Messages are decoded and handed to their job's diagnoser through the worker's own tables
(`streams.routing.decode_input` and `feed`), so `flare diagnose` on a recording finds what
the worker finds on the same stream; only the Kafka concerns (keys, partitions, dead
letters, event-time merge) are left out, since a recording is already in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson

from detectors.config import DetectorConfig
from detectors.diagnoser import JobDiagnoser
from schemas import InvalidMessage
from schemas.steps_decoder import StepsDecoder
from schemas.topics import INPUT_TOPICS
from schemas.wire import IncidentV1
from streams.routing import decode_input, feed


@dataclass(slots=True)
class OfflineResult:
    incidents: dict[str, IncidentV1] = field(default_factory=dict)  # final state per id
    events: list[IncidentV1] = field(default_factory=list)
    invalid: list[tuple[int, str]] = field(default_factory=list)  # (message index, reason)
    steps: int = 0


def diagnose_messages(
    messages: Iterable[tuple[str, bytes]], config: DetectorConfig | None = None
) -> OfflineResult:
    """Feed (topic, raw value) pairs, in order, to one JobDiagnoser per job."""
    res = OfflineResult()
    diags: dict[str, JobDiagnoser] = {}
    steps = StepsDecoder()  # the worker's decoder: same answers, cheaper on repeated columns

    def diag(job: str) -> JobDiagnoser:
        d = diags.get(job)
        if d is None:
            d = diags[job] = JobDiagnoser(job, config)
        return d

    for i, (topic, raw) in enumerate(messages):
        if topic not in INPUT_TOPICS:
            continue  # not an input of the worker either: nothing to diagnose
        try:
            msg = decode_input(topic, raw, steps)
            out = feed(diag(msg.job), msg)
        except InvalidMessage as exc:
            res.invalid.append((i, str(exc)))
            continue
        res.steps += len(out.reports)
        res.events.extend(out.incidents)
    for d in diags.values():
        out = d.flush()
        res.steps += len(out.reports)
        res.events.extend(out.incidents)
    for inc in res.events:
        res.incidents[inc.id] = inc
    return res


def recording_messages(path: str) -> Iterable[tuple[str, bytes]]:
    """A recorded stream as (topic, raw bytes), exactly as a consumer would receive them."""
    from producers.recording import read_recording

    for m in read_recording(path):
        raw = m.value if isinstance(m.value, bytes) else orjson.dumps(m.value)
        yield m.topic, raw
