"""The offline CLI: `flare simulate` → `flare diagnose` names the culprit; `flare eval` JSON."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from flare.cli import app
from flare.commands.evaluate import COLS

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
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert json.loads(r.stdout) == doc  # --json prints what --out writes, and no table
    keys = set(COLS)  # every column the table prints is in the JSON
    assert keys <= set(doc["overall"])
    assert {"slow_gpu", "nic", "clean"} <= set(doc["families"])
    assert all(keys <= set(m) for m in doc["families"].values())
    assert doc["gpus"] == [64] and doc["seeds"] == 1
    assert 0.0 <= doc["overall"]["top1"] <= 1.0
    assert doc["families"]["clean"]["false_per_10k_clean_steps"] == 0.0


def test_eval_rejects_bad_sizes():
    r = runner.invoke(app, ["eval", "--gpus", "4,x"])
    assert r.exit_code == 2
    assert "--gpus" in r.output
    r = runner.invoke(app, ["eval", "--gpus", "100", "--clean-steps", "0"])
    assert r.exit_code == 2 and "powers of two" in r.output  # not a traceback
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_a_port_out_of_range_is_a_usage_error_not_a_traceback():
    for cmd in (["api", "--port", "99999"], ["worker", "--api-port", "0"]):
        r = runner.invoke(app, cmd)
        assert r.exit_code == 2, (cmd, r.output)
        assert "port" in r.output and "Traceback" not in r.output


def test_a_worker_without_a_broker_says_so_in_one_line_after_its_short_wait(tmp_path,
                                                                            monkeypatch):
    from flare.local.broker import free_port

    monkeypatch.setenv("FLARE_BROKER_WAIT_S", "1")
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["worker", "--bootstrap", f"127.0.0.1:{free_port()}", "--quiet"])
    assert r.exit_code == 2, r.output
    (line,) = [ln for ln in r.output.splitlines() if ln.strip()]
    assert line.startswith("flare worker: no Kafka broker answered at 127.0.0.1:")
    assert line.endswith("within 1 s")  # the configured wait, not a minute


def test_eval_conditions_add_a_row_and_a_json_part_per_condition(tmp_path):
    out = tmp_path / "res.json"
    r = runner.invoke(
        app,
        ["eval", "--gpus", "64", "--clean-steps", "0", "--jobs", "1", "--families",
         "straggler", "--conditions", "base,step30+tp0", "--out", str(out)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["conditions"] == ["base", "step30+tp0"]
    for part in doc["by_condition"].values():
        assert set(part["families"]) == {"straggler"}
        assert part["overall"]["scenarios"] == 3  # severities 5, 10, 20
    assert "step30+tp0" in r.output and "straggler" in r.output
    bad = runner.invoke(app, ["eval", "--conditions", "base,tp9"])
    assert bad.exit_code != 0 and "unknown condition 'tp9'" in bad.output


def test_simulate_exposes_the_real_training_conditions(tmp_path):
    out = tmp_path / "run.jsonl"
    r = runner.invoke(
        app,
        ["simulate", "--gpus", "64", "--steps", "3", "--traced", "tp0", "--comm-only",
         "--seq-imbalance", "0.2", "--stage-imbalance", "1.3", "--step-time", "0.5",
         "--out", str(out)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    truth = json.loads((tmp_path / "run.truth.json").read_text())
    assert truth["conditions"] == {"traced": "tp0", "comm_only": True, "seq_imbalance": 0.2,
                                   "stage_imbalance": 1.3}  # fmt: skip
    steps = [json.loads(x)["value"] for x in out.read_text().splitlines()
             if '"flare.steps.v1"' in x]  # fmt: skip
    assert {v["rank"] % 8 for v in steps} == {0}
    assert all("compute" not in v["ops"]["kind"] for v in steps)
    bad = runner.invoke(app, ["simulate", "--traced", "some", "--out", str(out)])
    assert bad.exit_code == 2 and "traced must be one of" in bad.output
    r = runner.invoke(app, ["simulate", "--gpus", "64", "--steps", "4", "--fault", "nic",
                            "--fault2", "straggler", "--out", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    second = json.loads((tmp_path / "run.truth.json").read_text())["second"]
    assert second["family"] == "straggler" and second["severity"] == 10.0


def test_version_prints_one_line():
    from flare import __version__

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout == f"flare {__version__}\n"
