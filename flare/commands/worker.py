"""`flare worker` (being built; see the open issues)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("worker")
    def _cmd() -> None:
        """Not available yet."""
        typer.echo("flare worker is not available yet", err=True)
        raise typer.Exit(2)
