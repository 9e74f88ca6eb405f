"""`flare replay` (being built; see the open issues)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("replay")
    def _cmd() -> None:
        """Not available yet."""
        typer.echo("flare replay is not available yet", err=True)
        raise typer.Exit(2)
