"""`flare incidents`: what Flare has found, from a running API, for the on-call's terminal.

The embedded store belongs to the worker that serves the API (one process owns a chDB
directory), so the command asks the API, like any other client would.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import typer

KINDS = ("gpu", "node", "host", "link", "switch", "hang", "job")  # IncidentV1.kind


def incident_row(inc: dict[str, Any]) -> str:
    """One line: when it opened, its state, kind and culprit, the job, what it costs.

    >>> print(incident_row({"opened_ts_ns": 1_790_000_000_000_000_000, "status": "open",
    ...                     "kind": "gpu", "culprit": "rank:3", "job": "j", "summary": "slow",
    ...                     "lost_gpu_seconds": 7200.0, "lost_gpu_seconds_per_step": 4.0,
    ...                     "slowdown": 1.2}).replace("  costs", "\\n  costs"))
    2026-09-21 14:13:20Z  open      gpu     rank:3  j
      costs 2.0 GPU-h so far (4.0 GPU-s/step, job ×1.20)  slow
    """
    from flare.commands.up import cost_phrase

    opened = dt.datetime.fromtimestamp(int(inc["opened_ts_ns"]) / 1e9, tz=dt.UTC)
    return (f"{opened:%Y-%m-%d %H:%M:%S}Z  {inc['status']:<8}  {inc['kind']:<6}  "
            f"{inc['culprit']}  {inc['job']}  {cost_phrase(inc)}  {inc['summary']}")


def register(app: typer.Typer) -> None:
    @app.command("incidents")
    def incidents_cmd(
        job: str | None = typer.Option(None, help="only this job"),
        status: str | None = typer.Option(None, help="open or resolved"),
        kind: str | None = typer.Option(None, help=f"one of {', '.join(KINDS)}"),
        limit: int = typer.Option(100, min=1, max=10_000, help="at most this many, newest first"),
        as_json: bool = typer.Option(False, "--json", help="print the incidents as JSON"),
        api: str | None = typer.Option(
            None, envvar="FLARE_API_URL", show_envvar=True,
            help="the API's URL (default http://<FLARE_API_HOST>:<FLARE_API_PORT>)"),
    ) -> None:
        """List incidents from the running API, newest opening first."""
        import httpx
        import orjson

        from flare.api_client import api_client, api_url, error_detail
        from flare.settings import Settings

        if status is not None and status not in ("open", "resolved"):
            raise typer.BadParameter("must be open or resolved", param_hint="--status")
        if kind is not None and kind not in KINDS:
            raise typer.BadParameter(f"must be one of {', '.join(KINDS)}", param_hint="--kind")
        settings = Settings()
        api = api_url(settings, api)
        params: dict[str, Any] = {k: v for k, v in
                                  (("job", job), ("status", status), ("kind", kind)) if v}
        items: list[dict[str, Any]] = []
        cursor = None
        try:
            with api_client(settings, api) as client:
                while len(items) < limit:
                    page_params = {**params, "limit": min(1000, limit - len(items))}
                    if cursor:
                        page_params["cursor"] = cursor
                    r = client.get("/v1/incidents", params=page_params)
                    if r.status_code != 200:
                        typer.echo(f"flare incidents: {api} answered {r.status_code}: "
                                   f"{error_detail(r)}", err=True)
                        raise typer.Exit(2)
                    page = r.json()
                    items += page["items"]
                    cursor = page["next_cursor"]
                    if not cursor:
                        break
        except httpx.HTTPError as exc:
            typer.echo(f"flare incidents: no API at {api} ({type(exc).__name__}); start "
                       "`flare up` or `flare worker`, or pass --api", err=True)
            raise typer.Exit(2) from None
        if as_json:
            typer.echo(orjson.dumps(items[:limit], option=orjson.OPT_INDENT_2).decode())
            return
        for inc in items[:limit]:
            typer.echo(incident_row(inc))
        if not items:
            typer.echo("no incidents", err=True)
