"""The on-call's view of `flare up --simulate`, end to end, as issue #15 checks it: scrape its
metrics (promtool), receive its alert in a real Alertmanager, open its incident page in
headless Chromium, export its trace, run every Grafana panel's SQL through `flare sql`'s
route on the data it made, Ctrl-C it and find no incident added, run it again and see only
the new run.

Slow (two `flare up` runs, about 3 minutes), so it is not in the default test command:
`.venv/bin/python -m pytest -m slow` runs it (README, "Tests").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from flare.local.broker import free_port
from flare.local.processes import flare_argv
from storage.client import connect
from tests.integration.conftest import ROOT, wait_for
from tests.integration.test_alerts_alertmanager import active_alerts
from tests.integration.test_alerts_alertmanager import alertmanager as alertmanager  # noqa: F401
from tests.integration.test_grafana_dashboards import fill_macros

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PROMTOOL = shutil.which("promtool")
DASHBOARDS = sorted((ROOT / "infra/grafana/dashboards").glob("*.json"))
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None or PROMTOOL is None,
                       reason="needs Debian's chromium and prometheus (promtool)"),
]


class Up:
    """One `flare up --simulate --json` child: its incident lines as they come."""

    def __init__(self, data: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            flare_argv("up", "--simulate", "--gpus", "64", "--json", "--data-dir", str(data)),
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log.open("wb"),
            start_new_session=True)
        self.lines: list[dict[str, Any]] = []

    def first_incident(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(b"{"):
                self.lines.append(orjson.loads(line))
                return self.lines[-1]
        raise AssertionError(f"no incident line; its log:\n{self.log.read_text()[-3000:]}")

    def interrupt(self) -> int:
        """Ctrl-C, as a terminal sends it; the rest of its output is read."""
        os.killpg(self.proc.pid, signal.SIGINT)
        out, _ = self.proc.communicate(timeout=60)
        self.lines += [orjson.loads(x) for x in out.splitlines() if x.startswith(b"{")]
        return self.proc.returncode


def fill(sql: str, variables: dict[str, str]) -> str:
    """A dashboard query as Grafana sends it for the last day."""
    now = time.time_ns()
    return fill_macros(sql, variables, now - 86_400 * 10**9, now + 3_600 * 10**9)


@pytest.fixture
def env(alertmanager: str, tmp_path: Path) -> Iterator[dict[str, str]]:  # noqa: F811
    out = {**os.environ, "FLARE_KAFKA_PORT": str(free_port()),
           "FLARE_API_PORT": str(free_port()), "FLARE_ALERTMANAGER_URL": alertmanager,
           "FLARE_ALERT_RESEND_S": "1"}
    for var in ("FLARE_KAFKA_BOOTSTRAP", "FLARE_CLICKHOUSE_URL", "FLARE_API_KEY"):
        out.pop(var, None)
    yield out


def test_what_the_on_call_sees_of_flare_up(env: dict[str, str], alertmanager: str,  # noqa: F811
                                           tmp_path: Path) -> None:
    api = f"http://127.0.0.1:{env['FLARE_API_PORT']}"
    data = tmp_path / "data"
    up = Up(data, env, tmp_path / "up1.log")
    try:
        inc = up.first_incident(240)
        job, iid = inc["job"], inc["id"]
        assert inc["kind"] == "gpu" and job.startswith("sim-64-slow_gpu-")

        # metrics: promtool accepts the page, and it counts the open incident
        page = httpx.get(f"{api}/metrics", timeout=10).text
        lint = subprocess.run([str(PROMTOOL), "check", "metrics"], input=page, text=True,
                              capture_output=True, check=False)
        assert lint.returncode == 0, lint.stdout + lint.stderr
        assert re.search(r'^flare_open_incidents\{kind="gpu"\} [1-9]', page, re.M), page

        # the alert, in a real Alertmanager
        wait_for(lambda: bool(active_alerts(alertmanager, job)), 60, "the alert")
        (alert,) = active_alerts(alertmanager, job)
        assert alert["labels"]["culprit"] == inc["culprit"]
        assert alert["annotations"]["page"].endswith(f"/incidents/{iid}")

        # the incident page, in headless Chromium: the culprit is there, and it is drawn
        shot = tmp_path / "page.png"
        chrome = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
                  "--window-size=1200,1600"]
        subprocess.run([*chrome, f"--screenshot={shot}", f"{api}/incidents/{iid}"],
                       capture_output=True, timeout=120, check=True)
        assert shot.stat().st_size > 20_000  # a page with plots, not a blank one
        dom = subprocess.run([*chrome, "--dump-dom", f"{api}/incidents/{iid}"],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        assert inc["culprit"] in dom and "<svg" in dom

        # its trace, as Chrome trace events
        trace = tmp_path / "x.json"
        done = subprocess.run(flare_argv("trace", iid, "--out", str(trace), "--api", api),
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        events = json.loads(trace.read_text())["traceEvents"]
        assert events and all("ph" in e and "pid" in e for e in events)
        assert any(e["ph"] == "X" and e["dur"] >= 0 for e in events)

        # every dashboard query, on the data this run made, through the live store
        checked = 0
        for path in DASHBOARDS:
            board = json.loads(path.read_text())
            queries = [v["query"] for v in board["templating"]["list"]]
            queries += [t["rawSql"] for p in board["panels"] for t in p["targets"]]
            for sql in queries:
                r = httpx.post(f"{api}/v1/sql", json={"query": fill(sql, {
                    "job": job, "incident": iid})}, timeout=60)
                assert r.status_code == 200, (path.name, r.text)
                checked += 1
        assert checked >= 14
    finally:
        code = up.interrupt() if up.proc.poll() is None else up.proc.returncode
    assert code == 0, (tmp_path / "up1.log").read_text()[-3000:]

    # Ctrl-C added no incident: what is stored is what was printed
    printed = {line["id"] for line in up.lines}
    db = connect(f"chdb:///{(data / 'chdb').as_posix().lstrip('/')}")
    try:
        stored = {r["id"] for r in db.rows(
            f"SELECT DISTINCT id FROM {db.table('incidents')} FINAL WHERE job = {{j:String}}",
            {"j": job})}
    finally:
        db.close()
    assert stored == printed and iid in stored

    # a second run is a job of its own: only its incidents are printed
    again = Up(data, env, tmp_path / "up2.log")
    try:
        second = again.first_incident(240)
    finally:
        again.interrupt()
    assert second["job"] != job and all(line["job"] == second["job"] for line in again.lines)
