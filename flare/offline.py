"""Offline diagnosis of a recorded stream: the worker's code path without Kafka."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson

from detectors.config import DetectorConfig
from detectors.diagnoser import JobDiagnoser
from schemas import InvalidMessage
from schemas.decode import decode_heartbeat, decode_job
from schemas.steps_decoder import StepsDecoder
from schemas.wire import IncidentV1

STEPS, HEARTBEATS, JOBS = "flare.steps.v1", "flare.heartbeats.v1", "flare.jobs.v1"


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
        try:
            if topic == STEPS:
                msg = steps.decode(raw)
                out = diag(msg.job).on_steps(msg)
            elif topic == HEARTBEATS:
                hb = decode_heartbeat(raw)
                out = diag(hb.job).on_heartbeat(hb)
            elif topic == JOBS:
                ev = decode_job(raw)
                out = diag(ev.job).on_job(ev)
            else:
                continue
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
