"""`--json` is the same on every command that prints data: a flag that prints JSON on stdout.

Every command of the CLI is classified here, so a new command fails this test until someone
decides whether it prints data (then it needs `--json`) or not (and says why).
"""

from __future__ import annotations

import json
from typing import Any

import typer
from typer.core import TyperGroup, TyperOption
from typer.testing import CliRunner

from flare.cli import app
from flare.commands.up import incident_output

runner = CliRunner()

PRINTS_DATA = {"up", "simulate", "diagnose", "eval", "drill", "incidents", "sql"}
PRINTS_NO_DATA = {
    "replay": "publishes to Kafka (or writes --out); one line says how many messages",
    "chaos": "applies and undoes a fault; two lines say what it did",
    "worker": "a daemon",
    "shard-worker": "a daemon; logs its counts when it stops",
    "api": "a daemon",
    "agent": "a daemon; --dry-run prints the messages, JSON Lines already",
    "schemas": "writes the JSON Schema files; prints their paths",
    "trace": "prints the trace, JSON already, or writes it to --out",
}


def commands() -> dict[str, Any]:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    return dict(group.commands)


def test_every_command_is_classified() -> None:
    assert set(commands()) == PRINTS_DATA | set(PRINTS_NO_DATA), (
        "classify the new command: PRINTS_DATA (give it --json) or PRINTS_NO_DATA (say why)")
    assert not PRINTS_DATA & set(PRINTS_NO_DATA)


def test_every_command_that_prints_data_has_a_json_flag() -> None:
    for name in sorted(PRINTS_DATA):
        (option,) = [p for p in commands()[name].params if "--json" in getattr(p, "opts", [])]
        assert isinstance(option, TyperOption), name
        assert option.is_flag and not option.multiple and option.default is False, name
        assert option.help and "JSON" in option.help, name


def test_simulate_prints_one_truth_line_or_with_json_the_truth_file(tmp_path) -> None:
    out = tmp_path / "run.jsonl"
    argv = ["simulate", "--gpus", "8", "--steps", "4", "--fault", "slow_gpu", "--onset", "2",
            "--out", str(out)]
    r = runner.invoke(app, argv)
    assert r.exit_code == 0, r.output
    truth = json.loads((tmp_path / "run.truth.json").read_text())
    (line,) = r.stdout.splitlines()
    assert line.startswith(f"truth: slow_gpu ×1.5 on {truth['culprit']} (gpu) from step 2")
    r = runner.invoke(app, [*argv, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == truth


def test_up_prints_the_same_moments_as_json_lines() -> None:
    states = [
        {"id": "a", "culprit": "rank:3", "kind": "gpu", "status": "open", "job": "j",
         "lost_gpu_seconds": 100.0},
        {"id": "a", "culprit": "rank:3", "kind": "gpu", "status": "open", "job": "j",
         "lost_gpu_seconds": 150.0},  # not doubled: no line
        {"id": "a", "culprit": "rank:3", "kind": "gpu", "status": "open", "job": "j",
         "lost_gpu_seconds": 250.0},
        {"id": "a", "culprit": "rank:3", "kind": "gpu", "status": "resolved", "job": "j",
         "lost_gpu_seconds": 260.0},
    ]
    text: dict[str, float] = {}
    lines = [incident_output(s, text, as_json=False) for s in states]
    as_json: dict[str, float] = {}
    objects = [incident_output(s, as_json, as_json=True) for s in states]
    assert [line.split()[0] if line else None for line in lines] == [
        "INCIDENT", None, "UPDATE", "RESOLVED"]
    assert [json.loads(o) if o else None for o in objects] == [
        states[0], None, states[2], states[3]]
