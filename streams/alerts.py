"""Incidents as alerts: pushed to Alertmanager's v2 API and to a generic webhook.

An SRE is paged by Alertmanager, not by a Kafka topic. Each incident the worker emits becomes
one alert, identified by its labels (alertname, job, kind, culprit, severity: the same
incident always gives the same labels, so Alertmanager groups, inhibits and silences it like
any other alert). While the incident is open the alert is re-sent every `resend_s` with an
`endsAt` a few re-sends ahead, so it stays active while the worker lives and expires by
itself if the worker dies; its resolution is sent with `endsAt` at the moment it resolved.
The webhook gets each incident state as its v1 JSON, once per change.

Delivery never blocks diagnosis: failures are counted and logged, and the next re-send
repeats the open alerts. The HTTP side is one narrow seam (`Post`), faked in the tests.

>>> from storage.testing import make_incident
>>> alert = alertmanager_alert(make_incident("team/gpt", culprit="rank:3"), "http://flare:8000",
...                            now_ns=1_790_000_100_000_000_000, expires_s=180)
>>> sorted(alert["labels"].items())  # doctest: +NORMALIZE_WHITESPACE
[('alertname', 'FlareIncident'), ('culprit', 'rank:3'), ('job', 'team/gpt'), ('kind', 'gpu'),
 ('severity', 'critical')]
>>> alert["annotations"]["url"]
'http://flare:8000/v1/incidents/team/gpt/gpu/rank:3/10'
>>> alert["annotations"]["page"]
'http://flare:8000/incidents/team/gpt/gpu/rank:3/10'
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import msgspec

from schemas.clock import NS_PER_S, NanoClock
from schemas.redact import redact_url
from schemas.wire import IncidentV1

log = logging.getLogger(__name__)

ALERTNAME = "FlareIncident"
CRITICAL_SLOWDOWN = 1.10  # an incident slowing its job by 10% or more pages as critical
Post = Callable[[str, bytes], Awaitable[int]]  # (url, JSON body) -> HTTP status


def severity(inc: IncidentV1) -> str:
    """`critical` for a hang (the job stopped) or a fault costing ≥ 10% of the job's step
    time, `warning` for the rest (a job-wide shift with no device, a small slowdown)."""
    if inc.kind == "hang":
        return "critical"
    if inc.kind != "job" and inc.slowdown >= CRITICAL_SLOWDOWN:
        return "critical"
    return "warning"


def cost_text(inc: IncidentV1) -> str:
    """What the incident costs, as an on-call reads it in a page."""
    hours = inc.lost_gpu_seconds / 3600
    if inc.kind == "hang":
        return f"the job is stopped: {hours:.1f} GPU-hours lost so far"
    return (f"the job runs ×{inc.slowdown:.2f} slower; {inc.lost_gpu_seconds_per_step:.1f} "
            f"GPU-seconds lost per step, {hours:.1f} GPU-hours so far")


def _rfc3339(ns: int) -> str:
    return datetime.fromtimestamp(ns / NS_PER_S, tz=UTC).isoformat().replace("+00:00", "Z")


def incident_url(base_url: str, inc: IncidentV1) -> str:
    return f"{base_url.rstrip('/')}/v1/incidents/{quote(inc.id, safe='/:')}"


def page_url(base_url: str, inc: IncidentV1) -> str:
    """The incident's page for a person (HTML with its plots, served by the API)."""
    return f"{base_url.rstrip('/')}/incidents/{quote(inc.id, safe='/:')}"


def alertmanager_alert(inc: IncidentV1, base_url: str, now_ns: int, expires_s: float
                       ) -> dict[str, Any]:
    """The Alertmanager v2 `postableAlert` of one incident state at `now_ns`."""
    url = incident_url(base_url, inc)
    ends = now_ns if inc.status == "resolved" else now_ns + int(expires_s * NS_PER_S)
    return {
        "labels": {"alertname": ALERTNAME, "job": inc.job, "kind": inc.kind,
                   "culprit": inc.culprit, "severity": severity(inc)},
        "annotations": {"summary": inc.summary, "cost": cost_text(inc), "url": url,
                        "page": page_url(base_url, inc), "incident_id": inc.id},
        "startsAt": _rfc3339(min(inc.opened_ts_ns, now_ns)),
        "endsAt": _rfc3339(ends),
        "generatorURL": url,
    }


@dataclass(frozen=True, slots=True)
class AlertTargets:
    """Where incidents go: Alertmanager's base URL and a webhook URL (either may be empty),
    and the API base URL the alerts link to."""

    alertmanager_url: str = ""
    webhook_url: str = ""
    incident_base_url: str = "http://127.0.0.1:8000"
    resend_s: float = 60.0  # Alertmanager's own resolve_timeout is 5 min: stay well under

    @property
    def enabled(self) -> bool:
        return bool(self.alertmanager_url or self.webhook_url)


@dataclass(slots=True)
class AlertStats:
    sent: int = 0
    failed: int = 0
    webhook_sent: int = 0
    webhook_failed: int = 0
    last_error: str = ""


@dataclass(slots=True)
class Notifier:
    """Pushes incident states; keeps the open ones to re-send them."""

    targets: AlertTargets
    post: Post
    now_ns: NanoClock
    stats: AlertStats = field(default_factory=AlertStats)
    open: dict[str, IncidentV1] = field(default_factory=dict)
    _last_sent_ns: int = 0

    async def notify(self, incidents: list[IncidentV1]) -> None:
        """New incident states (in emission order): alert each one's newest, webhook all."""
        if not incidents or not self.targets.enabled:
            return
        newest: dict[str, IncidentV1] = {}
        for inc in incidents:
            newest[inc.id] = inc
            if inc.status == "open":
                self.open[inc.id] = inc
            else:
                self.open.pop(inc.id, None)
        if self.targets.webhook_url:
            for inc in incidents:
                await self._send_webhook(inc)
        await self._send_alerts(list(newest.values()))

    async def tick(self) -> None:
        """Re-send the open alerts once `resend_s` has passed since the last send."""
        if self.open and self.now_ns() - self._last_sent_ns >= self.targets.resend_s * NS_PER_S:
            await self._send_alerts(list(self.open.values()))

    async def _send_alerts(self, incidents: list[IncidentV1]) -> None:
        if not self.targets.alertmanager_url or not incidents:
            return
        now = self.now_ns()
        self._last_sent_ns = now
        body = msgspec.json.encode([
            alertmanager_alert(i, self.targets.incident_base_url, now, 3 * self.targets.resend_s)
            for i in incidents])
        url = f"{self.targets.alertmanager_url.rstrip('/')}/api/v2/alerts"
        if await self._post(url, body):
            self.stats.sent += len(incidents)
        else:
            self.stats.failed += len(incidents)

    async def _send_webhook(self, inc: IncidentV1) -> None:
        if await self._post(self.targets.webhook_url, msgspec.json.encode(inc)):
            self.stats.webhook_sent += 1
        else:
            self.stats.webhook_failed += 1

    async def _post(self, url: str, body: bytes) -> bool:
        # what the logs and the stats name: a receiver's URL can hold its credentials (user,
        # password, or a webhook's token in its path), so only scheme, host and port show
        shown = redact_url(url, opaque=True)
        try:
            status = await self.post(url, body)
        except Exception as exc:  # an unreachable Alertmanager must not stop the worker
            why = str(exc).replace(url, shown)
            self.stats.last_error = f"{shown}: {type(exc).__name__}: {why}"
            log.warning("could not deliver an alert: %s", self.stats.last_error)
            return False
        if status >= 300:
            self.stats.last_error = f"{shown}: HTTP {status}"
            log.warning("alert delivery refused: %s", self.stats.last_error)
            return False
        return True


def httpx_post(timeout_s: float = 5.0) -> Post:
    """The real `Post`: one shared async httpx client, JSON bodies.

    httpx logs every request's full URL at INFO, credentials and webhook token included;
    its logger is held to warnings, so a worker at FLARE_LOG_LEVEL=info leaks neither."""
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)
    client = httpx.AsyncClient(timeout=timeout_s)

    async def post(url: str, body: bytes) -> int:
        r = await client.post(url, content=body, headers={"Content-Type": "application/json"})
        return r.status_code

    return post
