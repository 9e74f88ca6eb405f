"""`flare up` (being built; see the open issues)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("up")
    def _cmd() -> None:
        """Not available yet."""
        typer.echo("flare up is not available yet", err=True)
        raise typer.Exit(2)
