"""The worker's Prometheus page, fed by a real pipeline over a simulated job with a fault."""

from __future__ import annotations

import re
import shutil
import subprocess

import orjson
import pytest

from detectors.diagnoser import JobDiagnoser
from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus
from schemas.testing import FakeClock
from schemas.topics import HEARTBEATS, INPUT_TOPICS, STEPS
from storage.testing import MemoryStore
from streams.pipeline import Record, build_pipeline


def _value(text: str, sample: str) -> float:
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    assert m is not None, f"{sample} not on the page"
    return float(m.group(1))


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    checked = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                             capture_output=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_page_counts_what_the_worker_read_found_and_could_not_use() -> None:
    sc = Scenario(job="met-32", layout=layout_for_gpus(32), steps=40, seed=3,
                  fault=Fault("slow_gpu", 1.5, 15, None), step_time_s=0.5)
    events = list(ClusterSimulator(sc).events())
    wall = FakeClock(max(ts for *_, ts in events) + 2_000_000_000)  # 2 s after the last event
    clock = FakeClock()
    pipe = build_pipeline(MemoryStore(), lambda job: JobDiagnoser(job),
                          max_message_bytes=1 << 20, stall_after_s=30.0, job_idle_s=3600.0,
                          now_s=clock.seconds, wall_ns=wall, version="9.9")
    pipe.on_assigned([(t, 0) for t in INPUT_TOPICS])
    records = [Record(topic, 0, i, key.encode(), orjson.dumps(value))
               for i, (topic, key, value, _ts) in enumerate(events)]
    bad = [Record(STEPS, 0, len(records), b"met-32", b'{"v":3}'),
           Record(HEARTBEATS, 0, len(records) + 1, None, b"nope")]
    pipe.progress.set_highwater(STEPS, 0, len(records) + 10)  # ten more than read
    pipe.on_records(records + bad)
    list(pipe.ticks())
    assert pipe.flush()
    text = pipe.metrics_text()

    steps = sum(1 for r in records if r.topic == STEPS) + 1
    assert _value(text, f'flare_worker_messages_total{{topic="{STEPS}"}}') == steps
    assert _value(text, 'flare_worker_dead_letters_total{reason="$.v"}') == 1
    assert _value(text, 'flare_worker_dead_letters_total{reason="$"}') == 1
    # the last steps record read has offset len(records): 9 of the 10 beyond it are unread
    lag = f'flare_worker_consumer_lag_messages{{partition="0",topic="{STEPS}"}}'
    assert _value(text, lag) == 9
    behind = f'flare_worker_event_time_lag_seconds{{topic="{STEPS}"}}'
    assert _value(text, behind) == pytest.approx(2.0, abs=0.6)
    assert _value(text, "flare_worker_step_diagnosis_seconds_count") == pipe.stats.reports > 0
    assert _value(text, 'flare_open_incidents{kind="gpu"}') == 1
    assert _value(text, 'flare_lost_gpu_seconds_total{kind="gpu"}') > 0
    assert _value(text, 'flare_build_info{version="9.9"}') == 1
    promtool_check(text)


def test_lost_gpu_seconds_count_each_incidents_increase_once() -> None:
    from storage.testing import make_incident
    from streams.metrics import WorkerMetrics

    m = WorkerMetrics(FakeClock())
    for lost, status in ((10.0, "open"), (25.0, "open"), (25.0, "open"), (40.0, "resolved")):
        m.incident(make_incident("j", lost_gpu_seconds=lost, status=status,
                                 resolved_step=30 if status == "resolved" else None))
    text = m.render(lag={}, dead_letters={}, jobs=0, storage_ok=True)
    assert _value(text, 'flare_lost_gpu_seconds_total{kind="gpu"}') == 40.0
    assert "flare_open_incidents{" not in text  # resolved: no longer open
