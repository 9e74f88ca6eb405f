"""`flare diagnose run.jsonl`: the detectors over a recorded stream, offline."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("diagnose")
    def diagnose_cmd(
        recording: Path = typer.Argument(
            ..., exists=True, dir_okay=False, help="a .jsonl recording"
        ),
        as_json: bool = typer.Option(False, "--json", help="print a JSON list of incident v1"),
    ) -> None:
        """Print the incidents Flare finds in a recorded stream (final state of each)."""
        import msgspec
        from rich.console import Console
        from rich.table import Table

        from flare.offline import diagnose_messages, recording_messages
        from producers.recording import RecordingError

        try:
            res = diagnose_messages(recording_messages(str(recording)))
        except RecordingError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        incidents = sorted(res.incidents.values(), key=lambda i: (i.opened_step, i.id))
        err = Console(stderr=True)
        for idx, reason in res.invalid[:20]:
            err.print(f"[yellow]invalid message #{idx}: {reason}[/yellow]")
        if as_json:
            typer.echo(msgspec.json.encode(incidents).decode())
            return
        table = Table(
            title=f"{len(incidents)} incident(s) in {res.steps} steps of {recording.name}"
        )
        for c in ("job", "kind", "culprit", "status", "onset", "opened", "slowdown", "summary"):
            table.add_column(c)
        for i in incidents:
            table.add_row(
                i.job,
                i.kind,
                i.culprit,
                i.status,
                str(i.onset_step),
                str(i.opened_step),
                f"×{i.slowdown:.2f}",
                i.summary,
            )
        Console().print(table)
