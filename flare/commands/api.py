"""`flare api`: serve the HTTP API over an existing ClickHouse (FLARE_CLICKHOUSE_URL).

This is the stateless API replica of a production deployment (N of them behind a balancer,
a ClickHouse server behind them). With embedded chDB the worker serves the API itself (one
process owns a chDB data directory), so this command is for a server, or for reading a chDB
directory no worker is using.
"""

from __future__ import annotations

from typing import Any

import typer

UVICORN_LEVELS = {"crit": "critical", "error": "error", "warn": "warning", "info": "info",
                  "debug": "debug"}


def register(app: typer.Typer) -> None:
    @app.command("api")
    def api_cmd(
        clickhouse_url: str | None = typer.Option(
            None, envvar="FLARE_CLICKHOUSE_URL", show_envvar=True,
            help="chdb:///path or http(s)://user@host:port/db (default chdb:///./data/chdb)",
        ),
        host: str | None = typer.Option(
            None, envvar="FLARE_API_HOST", show_envvar=True,
            help="interface to bind (default 127.0.0.1)",
        ),
        port: int | None = typer.Option(
            None, envvar="FLARE_API_PORT", show_envvar=True, help="port (default 8000)",
            min=1, max=65535,
        ),
        wait_s: float = typer.Option(
            30.0, "--wait", help="seconds to wait for ClickHouse to answer before giving up"
        ),
        migrate: bool = typer.Option(
            True, help="apply the DDL migrations the database has not recorded yet, so an "
            "empty ClickHouse works (a changed, already applied migration exits 1)"
        ),
    ) -> None:
        """Serve /v1 incidents, jobs, steps and ranks, /healthz, /readyz and /openapi.json
        (/v1 needs FLARE_API_KEY in X-API-Key when it is set)."""
        import uvicorn

        from api.app import create_app
        from flare.settings import Settings
        from storage.adhoc import open_readonly
        from storage.client import StorageError, connect_when_ready
        from storage.migrations import apply_schema
        from storage.reader import Queries

        overrides: dict[str, Any] = {
            "clickhouse_url": clickhouse_url, "api_host": host, "api_port": port
        }
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
        try:
            db = connect_when_ready(
                settings.clickhouse_url, settings.clickhouse_password, timeout_s=wait_s,
                connect_timeout_s=settings.clickhouse_connect_timeout_s,
                read_timeout_s=settings.clickhouse_read_timeout_s,
            )
        except (StorageError, ValueError) as exc:
            typer.echo(f"flare api: {exc}", err=True)
            raise typer.Exit(1) from None
        try:
            if migrate:
                apply_schema(db)
            sql = open_readonly(settings.clickhouse_url, settings.clickhouse_password)
        except StorageError as exc:  # MigrationError too: a shipped migration was changed
            db.close()  # frees an embedded engine's data directory
            typer.echo(f"flare api: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(
            f"flare api: ClickHouse {db.location}, serving "
            f"http://{settings.api_host}:{settings.api_port} (OpenAPI at /openapi.json)",
            err=True,
        )
        try:
            uvicorn.run(
                create_app(Queries(db), api_key=settings.api_key, sql=sql),
                host=settings.api_host,
                port=settings.api_port,
                log_level=UVICORN_LEVELS.get(settings.log_level, "warning"),
            )
        finally:
            sql.close()
            db.close()
