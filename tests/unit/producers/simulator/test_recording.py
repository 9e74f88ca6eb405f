"""A scenario written as a recording with its truth, and `flare simulate` around it."""

from __future__ import annotations

import orjson

from producers.simulator import ClusterSimulator, Fault
from tests.unit.producers.simulator.support import scenario


def test_write_recording_and_cli(tmp_path):
    import typer
    from typer.testing import CliRunner

    from flare.commands import simulate
    from producers.simulator import read_truth, write_recording

    sc = scenario(steps=3, fault=Fault("slow_node", 1.3, 1))
    truth = write_recording(sc, tmp_path / "a" / "run.jsonl")
    lines = (tmp_path / "a" / "run.jsonl").read_bytes().splitlines()
    assert {orjson.loads(x)["topic"] for x in lines} == {
        "flare.jobs.v1", "flare.steps.v1", "flare.heartbeats.v1"}  # fmt: skip
    assert read_truth(tmp_path / "a" / "run.jsonl") == truth
    assert truth == ClusterSimulator(sc).truth

    app = typer.Typer()
    simulate.register(app)
    app.command("noop")(lambda: None)
    out = tmp_path / "cli.jsonl"
    res = CliRunner().invoke(app, ["simulate", "--gpus", "16", "--steps", "3", "--fault",
                                   "slow_gpu", "--onset", "1", "--target", "rank:3",
                                   "--no-heartbeats", "--out", str(out), "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert read_truth(out).culprit == "rank:3"
    assert '"culprit": "rank:3"' in res.output
    assert not any(b"heartbeats" in x for x in out.read_bytes().splitlines())
    res = CliRunner().invoke(app, ["simulate", "--gpus", "8", "--fault", "switch",
                                   "--out", str(tmp_path / "x.jsonl")])  # fmt: skip
    assert res.exit_code == 2 and "2 leaf switches" in res.output
