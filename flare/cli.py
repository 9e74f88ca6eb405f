"""`flare`: the one command line for every Flare process.

Each subcommand lives in its own module under `flare.commands` and registers itself; heavy
imports (faust, chDB, torch) happen inside the command, so `flare --help` stays fast.
"""

from __future__ import annotations

import typer

from flare.commands import (
    agent,
    api,
    chaos,
    diagnose,
    drill,
    evaluate,
    incidents,
    replay,
    schemas,
    shard_worker,
    simulate,
    sql,
    trace,
    up,
    worker,
)

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Flare: find the GPU, node, host or link that slows a distributed training job.",
)

def _print_version(value: bool) -> None:
    if value:
        from flare import __version__

        typer.echo(f"flare {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="print Flare's version and exit"),
) -> None:
    """Flare: find the GPU, node, host or link that slows a distributed training job."""


for _module in (up, simulate, replay, diagnose, evaluate, drill, chaos, worker, shard_worker, api,
                agent, incidents, sql, trace, schemas):
    _module.register(app)


def main() -> None:
    app()
