"""The offline CLI: `flare simulate` → `flare diagnose` names the culprit; `flare eval` JSON."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from flare.cli import app

runner = CliRunner()


def test_simulate_then_diagnose_names_the_injected_culprit(tmp_path):
    out = tmp_path / "run.jsonl"
    r = runner.invoke(
        app,
        [
            "simulate",
            "--gpus",
            "64",
            "--steps",
            "40",
            "--fault",
            "slow_node",
            "--severity",
            "1.4",
            "--onset",
            "15",
            "--seed",
            "3",
            "--no-heartbeats",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    truth = json.loads((tmp_path / "run.truth.json").read_text())
    r = runner.invoke(app, ["diagnose", str(out), "--json"])
    assert r.exit_code == 0, r.output
    incidents = json.loads(r.stdout)
    assert incidents[0]["culprit"] == truth["culprit"]
    assert incidents[0]["kind"] == "node"
    assert incidents[0]["v"] == 1
    assert abs(incidents[0]["onset_step"] - 15) <= 1  # an estimate: the first step of evidence


def test_diagnose_reports_a_bad_recording_line_with_its_position(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"topic": "flare.steps.v1", "key": "j", "value": {"v": 1}}\nnot json\n')
    r = runner.invoke(app, ["diagnose", str(bad)])
    assert r.exit_code == 2
    assert "bad.jsonl:2" in r.output


def test_eval_json_has_the_documented_shape(tmp_path):
    out = tmp_path / "res.json"
    r = runner.invoke(
        app,
        [
            "eval",
            "--gpus",
            "64",
            "--seeds",
            "1",
            "--clean-steps",
            "250",
            "--jobs",
            "1",
            "--families",
            "slow_gpu,nic",
            "--json",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    keys = {
        "scenarios",
        "top1",
        "top3",
        "kind",
        "false_per_10k_clean_steps",
        "latency_steps_median",
        "latency_s_median",
        "repeats_per_fault_run",
    }
    assert keys <= set(doc["overall"])
    assert {"slow_gpu", "nic", "clean"} <= set(doc["families"])
    assert all(keys <= set(m) for m in doc["families"].values())
    assert doc["gpus"] == [64] and doc["seeds"] == 1
    assert 0.0 <= doc["overall"]["top1"] <= 1.0
    assert doc["families"]["clean"]["false_per_10k_clean_steps"] == 0.0


def test_eval_rejects_bad_sizes():
    r = runner.invoke(app, ["eval", "--gpus", "4,x"])
    assert r.exit_code != 0
    assert "--gpus" in r.output
