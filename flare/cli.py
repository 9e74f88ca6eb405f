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
    simulate,
    up,
    worker,
)

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Flare: find the GPU, node, host or link that slows a distributed training job.",
)

for _module in (up, simulate, replay, diagnose, evaluate, drill, chaos, worker, api, agent,
                incidents, schemas):
    _module.register(app)


def main() -> None:
    app()
