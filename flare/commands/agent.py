"""`flare agent` (being built; see the open issues)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("agent")
    def _cmd() -> None:
        """Not available yet."""
        typer.echo("flare agent is not available yet", err=True)
        raise typer.Exit(2)
