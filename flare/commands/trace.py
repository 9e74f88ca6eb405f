"""`flare trace INCIDENT`: an incident's evidence steps as a Chrome/Perfetto trace file.

Like `flare incidents`, it asks the running API (the worker that owns the embedded store
serves it), so it works the same against a laptop's `flare up` and a production API; the
trace itself is built by the API (`GET /v1/incidents/{id}/trace`, layout in
`schemas.chrome_trace`), so a browser, a script and this command get the same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import typer

MAX_STEPS = 50  # the API's bound (api.routes.incidents.TRACE_MAX_STEPS)


def summary(path: str, other: dict[str, Any]) -> str:
    """One line saying what the trace holds, or why it is empty.

    >>> print(summary("x.json", {"steps": [30, 31], "ranks": 4, "ops": 16, "more_steps": True,
    ...                          "truncated": False, "from_step": 30, "to_step": 59}))
    wrote x.json: steps 30, 31 of 30-59 (more stored: --steps), 4 ranks, 16 ops; open it in
    ui.perfetto.dev
    """
    if not other.get("steps"):
        return (f"wrote {path}: an empty trace: no raw ops are stored for steps "
                f"{other.get('from_step')}-{other.get('to_step')} (Flare keeps them for "
                "irregular and sampled steps, 7 days)")
    more = " (more stored: --steps)" if other.get("more_steps") else ""
    cut = " (cut to the API's op budget)" if other.get("truncated") else ""
    steps = ", ".join(str(s) for s in other["steps"])
    return (f"wrote {path}: steps {steps} of {other['from_step']}-{other['to_step']}{more}, "
            f"{other['ranks']} ranks, {other['ops']} ops{cut}; open it in ui.perfetto.dev")


def register(app: typer.Typer) -> None:
    @app.command("trace")
    def trace_cmd(
        incident: str = typer.Argument(..., help="the incident's id (as `flare incidents` "
                                                 "--json shows it)"),
        out: Path | None = typer.Option(None, "--out", "-o", dir_okay=False,
                                        help="write the trace here (default: print it)"),
        steps: int = typer.Option(5, min=1, max=MAX_STEPS,
                                  help="at most this many evidence steps, from the onset"),
        api: str | None = typer.Option(
            None, envvar="FLARE_API_URL", show_envvar=True,
            help="the API's URL (default http://<FLARE_API_HOST>:<FLARE_API_PORT>); "
                 "FLARE_API_KEY is sent when set"),
    ) -> None:
        """Write an incident's evidence steps as a Chrome/Perfetto trace: one track per rank,
        collectives grouped by communicator (open it in ui.perfetto.dev)."""
        import httpx
        import orjson

        from flare.api_client import api_client, api_url, error_detail
        from flare.settings import Settings

        settings = Settings()
        api = api_url(settings, api)
        path = f"/v1/incidents/{quote(incident, safe='/:@')}/trace"
        try:  # a trace of the largest size takes the API seconds to read and build
            with api_client(settings, api, timeout_s=120.0) as client:
                r = client.get(path, params={"steps": steps})
        except httpx.HTTPError as exc:
            typer.echo(f"flare trace: no API at {api} ({type(exc).__name__}); start "
                       "`flare up` or `flare worker`, or pass --api", err=True)
            raise typer.Exit(2) from None
        if r.status_code != 200:
            typer.echo(f"flare trace: {api} answered {r.status_code}: {error_detail(r)}",
                       err=True)
            raise typer.Exit(2)
        if out is None:
            typer.echo(r.text)
            return
        try:
            out.write_bytes(r.content)
        except OSError as exc:
            typer.echo(f"flare trace: cannot write {out}: {exc.strerror}", err=True)
            raise typer.Exit(2) from None
        other = orjson.loads(r.content).get("otherData", {})
        typer.echo(summary(str(out), other), err=not other.get("steps"))
