"""Incidents as alerts, against a fake HTTP seam that records what would be posted."""

from __future__ import annotations

import asyncio
from datetime import datetime

import msgspec
import orjson
import pytest

from schemas.testing import FakeClock
from storage.testing import make_incident
from streams.alerts import AlertTargets, Notifier, severity

AM = "http://am:9093"
HOOK = "http://hooks/flare"


class FakePost:
    def __init__(self, status: int = 200, fail: bool = False) -> None:
        self.calls: list[tuple[str, object]] = []
        self.status, self.fail = status, fail

    async def __call__(self, url: str, body: bytes) -> int:
        self.calls.append((url, orjson.loads(body)))
        if self.fail:
            raise ConnectionError("refused")
        return self.status


def _notifier(post: FakePost, clock: FakeClock, **targets: object) -> Notifier:
    t = AlertTargets(**{"alertmanager_url": AM, "webhook_url": HOOK,  # type: ignore[arg-type]
                        "incident_base_url": "http://flare:8000", "resend_s": 60.0, **targets})
    return Notifier(t, post, clock)


def test_an_incident_is_an_alert_re_sent_while_open_and_ended_on_resolve() -> None:
    clock, post = FakeClock(), FakePost()
    n = _notifier(post, clock)
    opened = make_incident("j", culprit="rank:3", opened_ts_ns=clock())
    asyncio.run(n.notify([opened]))
    (hook_url, state), (am_url, alerts) = post.calls
    assert (hook_url, state["culprit"], state["status"]) == (HOOK, "rank:3", "open")
    assert am_url == f"{AM}/api/v2/alerts"
    (alert,) = alerts  # type: ignore[misc]
    assert alert["labels"] == {"alertname": "FlareIncident", "job": "j", "kind": "gpu",
                               "culprit": "rank:3", "severity": "critical"}
    assert alert["annotations"]["url"] == "http://flare:8000/v1/incidents/j/gpu/rank:3/10"
    assert alert["annotations"]["page"] == "http://flare:8000/incidents/j/gpu/rank:3/10"
    assert "slower" in alert["annotations"]["cost"] and alert["annotations"]["summary"]
    assert alert["endsAt"] > alert["startsAt"]  # active for a few re-sends ahead
    post.calls.clear()
    clock.advance(30)
    asyncio.run(n.tick())
    assert post.calls == []  # not due yet
    clock.advance(31)
    asyncio.run(n.tick())
    assert [u for u, _ in post.calls] == [f"{AM}/api/v2/alerts"]  # re-sent while open
    post.calls.clear()
    resolved = msgspec.structs.replace(opened, status="resolved", resolved_step=30)
    asyncio.run(n.notify([resolved]))
    (_, state), (_, (ended,)) = post.calls  # type: ignore[misc]
    assert state["status"] == "resolved"
    ends = datetime.fromisoformat(ended["endsAt"].replace("Z", "+00:00")).timestamp()
    assert ends == pytest.approx(clock() / 1e9, abs=1e-3)  # ended now
    post.calls.clear()
    clock.advance(120)
    asyncio.run(n.tick())
    assert post.calls == []  # nothing open: nothing re-sent


def test_only_the_newest_state_of_an_incident_is_alerted_and_delivery_never_raises() -> None:
    clock, post = FakeClock(), FakePost(fail=True)
    n = _notifier(post, clock, webhook_url="")
    states = [make_incident("j", last_step=s) for s in (12, 13, 14)]
    asyncio.run(n.notify(states))
    ((_, alerts),) = post.calls
    assert len(alerts) == 1  # type: ignore[arg-type]
    assert n.stats.failed == 1 and "refused" in n.stats.last_error
    refused = _notifier(FakePost(status=400), clock, webhook_url="")
    asyncio.run(refused.notify(states))
    assert refused.stats.failed == 1 and "HTTP 400" in refused.stats.last_error


def test_severity_pages_hangs_and_costly_faults_and_warns_of_the_rest() -> None:
    inc = make_incident("j")
    assert severity(msgspec.structs.replace(inc, kind="hang", slowdown=1.0)) == "critical"
    assert severity(msgspec.structs.replace(inc, slowdown=1.25)) == "critical"
    assert severity(msgspec.structs.replace(inc, slowdown=1.04)) == "warning"
    assert severity(msgspec.structs.replace(inc, kind="job", culprit="job",
                                            slowdown=1.5)) == "warning"


def test_without_targets_nothing_is_sent() -> None:
    post = FakePost()
    n = Notifier(AlertTargets(), post, FakeClock())
    asyncio.run(n.notify([make_incident("j")]))
    asyncio.run(n.tick())
    assert post.calls == [] and not n.targets.enabled
