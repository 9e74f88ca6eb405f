"""`flare schemas`: regenerate the checked-in JSON Schema files from the wire models."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("schemas")
    def schemas_cmd(
        out: Path = typer.Option(Path("schemas/jsonschema"), help="folder for the .json files"),
    ) -> None:
        """Write one JSON Schema file per v1 topic (generated from schemas/wire.py)."""
        from schemas.jsonschema_gen import write_schemas

        for path in write_schemas(out):
            typer.echo(str(path))
