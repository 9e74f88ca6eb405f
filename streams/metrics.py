"""The stream worker's own Prometheus metrics: is the diagnosis service keeping up, and what
has it found.

An SRE pages on Flare's incidents, and also needs to know when Flare itself falls behind or
drops input. The pipeline feeds this object as it goes (per record: one counter and one max;
per diagnosed message: two clock reads), and `render` writes the page from it and from the
pipeline's own progress and dead-letter counters:

- `flare_worker_messages_total{topic}`: records consumed;
- `flare_worker_dead_letters_total{reason}`: inputs that could not be used, by cause;
- `flare_worker_consumer_lag_messages{topic,partition}`: messages not read yet;
- `flare_worker_event_time_lag_seconds{topic}`: wall clock minus the newest event time read
  (how far behind the training the diagnosis is);
- `flare_worker_step_diagnosis_seconds`: a histogram of the time the detectors took per
  assembled step;
- `flare_open_incidents{kind}` and `flare_lost_gpu_seconds_total{kind}`: what the incidents
  this worker emitted cost, as a counter of the what-if estimate's increases;
- `flare_worker_jobs`, `flare_worker_storage_ok` and `flare_build_info{version}`.

Time is an input: the wall clock for the event-time lag comes from the caller.

>>> from schemas.testing import FakeClock
>>> m = WorkerMetrics(FakeClock(5_000_000_000), version="1.2.3")
>>> m.messages["flare.steps.v1"] += 2
>>> m.event_time("flare.steps.v1", 3_500_000_000)
>>> m.observe_diagnosis(0.004, steps=1)
>>> text = m.render(lag={}, dead_letters={}, jobs=1, storage_ok=True)
>>> 'flare_worker_event_time_lag_seconds{topic="flare.steps.v1"} 1.5' in text
True
>>> 'flare_worker_step_diagnosis_seconds_bucket{le="0.005"} 1' in text
True
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from schemas.clock import NS_PER_S, NanoClock
from schemas.prometheus import Exposition
from schemas.wire import IncidentV1

# Seconds to diagnose one step: ~1 ms at 64 GPUs, ~0.5 s at 8,192 (BENCHMARKS.md).
DIAGNOSIS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
MAX_TRACKED_INCIDENTS = 100_000  # open ones are few; resolved ones are forgotten at once


class WorkerMetrics:
    """Counters and gauges of one worker, fed by its pipeline."""

    def __init__(self, wall_ns: NanoClock, version: str = "") -> None:
        self.wall_ns = wall_ns
        self.version = version
        self.messages: Counter[str] = Counter()
        self.newest_event_ns: dict[str, int] = {}
        self._diagnosis = np.zeros(len(DIAGNOSIS_BOUNDS) + 1, dtype=np.int64)  # per bucket
        self._diagnosis_sum = 0.0
        self._open: dict[str, str] = {}  # incident id -> kind, while open
        self._lost: dict[str, float] = {}  # incident id -> lost GPU-seconds last reported
        self.lost_gpu_seconds: dict[str, float] = {}  # by kind

    def event_time(self, topic: str, time_ns: int) -> None:
        if time_ns > self.newest_event_ns.get(topic, 0):
            self.newest_event_ns[topic] = time_ns

    def observe_diagnosis(self, seconds: float, steps: int) -> None:
        """`steps` steps were assembled and diagnosed in `seconds` (one message's work)."""
        per = seconds / max(steps, 1)
        self._diagnosis[int(np.searchsorted(DIAGNOSIS_BOUNDS, per))] += steps
        self._diagnosis_sum += seconds

    def incident(self, inc: IncidentV1) -> None:
        """An incident state was emitted: count it open or not, and its new cost."""
        before = self._lost.get(inc.id, 0.0)
        if inc.lost_gpu_seconds > before:
            self.lost_gpu_seconds[inc.kind] = (self.lost_gpu_seconds.get(inc.kind, 0.0)
                                               + inc.lost_gpu_seconds - before)
        if inc.status == "open":
            if len(self._open) < MAX_TRACKED_INCIDENTS or inc.id in self._open:
                self._open[inc.id] = inc.kind
                self._lost[inc.id] = max(before, inc.lost_gpu_seconds)
        else:
            self._open.pop(inc.id, None)
            self._lost.pop(inc.id, None)

    def render(self, *, lag: dict[tuple[str, int], int], dead_letters: dict[str, int],
               jobs: int, storage_ok: bool) -> str:
        """The page: this object's figures plus the pipeline's lag per topic-partition and
        dead letters by cause."""
        page = Exposition()
        page.family("flare_build_info", "gauge", "Flare's version, as a label; always 1.")
        page.sample("flare_build_info", {"version": self.version or "unknown"}, 1)
        page.family("flare_worker_messages_total", "counter", "Records consumed, by topic.")
        for topic, n in sorted(self.messages.items()):
            page.sample("flare_worker_messages_total", {"topic": topic}, n)
        page.family("flare_worker_dead_letters_total", "counter",
                    "Inputs that could not be used and went to the dead-letter topic, by cause.")
        for reason, n in sorted(dead_letters.items()):
            page.sample("flare_worker_dead_letters_total", {"reason": reason}, n)
        page.family("flare_worker_consumer_lag_messages", "gauge",
                    "Messages of an assigned topic-partition not read yet.")
        for (topic, part), n in sorted(lag.items()):
            page.sample("flare_worker_consumer_lag_messages",
                        {"topic": topic, "partition": str(part)}, n)
        page.family("flare_worker_event_time_lag_seconds", "gauge",
                    "Wall clock minus the newest event time read, by topic: how far the "
                    "diagnosis is behind the training.")
        now = self.wall_ns()
        for topic, ts in sorted(self.newest_event_ns.items()):
            page.sample("flare_worker_event_time_lag_seconds", {"topic": topic},
                        max(now - ts, 0) / NS_PER_S)
        page.family("flare_worker_step_diagnosis_seconds", "histogram",
                    "Seconds the detectors took per assembled step.")
        page.histogram_samples("flare_worker_step_diagnosis_seconds", {}, DIAGNOSIS_BOUNDS,
                               np.cumsum(self._diagnosis[:-1]).tolist(), self._diagnosis_sum,
                               int(self._diagnosis.sum()))
        page.family("flare_open_incidents", "gauge",
                    "Incidents this worker has open, by kind.")
        for kind, n in sorted(Counter(self._open.values()).items()):
            page.sample("flare_open_incidents", {"kind": kind}, n)
        page.family("flare_lost_gpu_seconds_total", "counter",
                    "GPU-seconds lost to the incidents this worker emitted (their what-if "
                    "cost), by kind.")
        for kind, s in sorted(self.lost_gpu_seconds.items()):
            page.sample("flare_lost_gpu_seconds_total", {"kind": kind}, float(s))
        page.family("flare_worker_jobs", "gauge", "Jobs whose state this worker holds.")
        page.sample("flare_worker_jobs", {}, jobs)
        page.family("flare_worker_storage_ok", "gauge",
                    "1 while the last write to ClickHouse succeeded.")
        page.sample("flare_worker_storage_ok", {}, int(storage_ok))
        return page.text()
