"""`flare trace` against a real API server (uvicorn on loopback) over the sample store: the
trace file, stdout without --out, and one line with exit 2 for every failure."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from api.app import create_app
from flare.cli import app
from flare.local.broker import free_port
from storage.testing import SAMPLE_JOB, MemoryStore, load_sample
from tests.live_api import served
from tests.unit.schemas.test_trace_builder import well_formed

runner = CliRunner()
GPU = f"{SAMPLE_JOB}/gpu/rank:1/30"


@contextmanager
def serve(**app_options: Any) -> Iterator[str]:
    """The API over the sample store, served by uvicorn on a free loopback port."""
    store = MemoryStore()
    load_sample(store)
    with served(create_app(store, **app_options)) as url:
        yield url


@pytest.fixture(scope="module")
def api_url() -> Iterator[str]:
    with serve() as url:
        yield url


def one_line(output: str) -> str:
    (line,) = [ln for ln in output.splitlines() if ln.strip()]
    return line


def test_the_trace_is_written_and_summed_up(api_url: str, tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    r = runner.invoke(app, ["trace", GPU, "--out", str(out), "--api", api_url, "--steps", "2"])
    assert r.exit_code == 0, r.output
    trace = orjson.loads(out.read_bytes())
    well_formed(trace)
    assert trace["otherData"]["steps"] == [30, 31] and trace["otherData"]["incident"] == GPU
    assert one_line(r.output) == (f"wrote {out}: steps 30, 31 of 30-59 (more stored: --steps), "
                                  "4 ranks, 16 ops; open it in ui.perfetto.dev")


def test_without_out_the_trace_goes_to_stdout(api_url: str, monkeypatch) -> None:
    monkeypatch.setenv("FLARE_API_URL", api_url)
    r = runner.invoke(app, ["trace", GPU, "--steps", "1"])
    assert r.exit_code == 0, r.output
    trace = orjson.loads(r.stdout)
    well_formed(trace)
    assert trace["otherData"]["steps"] == [30]


def test_an_incident_without_stored_ops_writes_an_empty_trace(api_url: str,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "empty.json"
    r = runner.invoke(app, ["trace", f"{SAMPLE_JOB}/link/node:node-1/5", "-o", str(out),
                            "--api", api_url])
    assert r.exit_code == 0, r.output
    assert orjson.loads(out.read_bytes())["traceEvents"] == []
    assert "no raw ops are stored for steps 5-20" in one_line(r.output)


@pytest.mark.parametrize(("args", "says"), [
    (["nope/gpu/rank:0/1"], "answered 404: no incident with id 'nope/gpu/rank:0/1'"),
    (["--out", "{tmp}/no/such/dir/x.json", GPU], "cannot write"),
])
def test_failures_are_one_line_and_exit_2(api_url: str, tmp_path: Path, args: list[str],
                                          says: str) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = runner.invoke(app, ["trace", "--api", api_url, *args])
    assert r.exit_code == 2
    line = one_line(r.output)
    assert line.startswith("flare trace: ") and says in line


def test_a_missing_api_and_bad_steps_exit_2() -> None:
    r = runner.invoke(app, ["trace", GPU, "--api", f"http://127.0.0.1:{free_port()}"])
    assert r.exit_code == 2
    assert one_line(r.output).startswith("flare trace: no API at http://127.0.0.1:")
    r = runner.invoke(app, ["trace", GPU, "--steps", "0"])
    assert r.exit_code == 2 and "--steps" in r.output


def test_a_guarded_api_gets_the_key_from_flare_api_key(tmp_path: Path, monkeypatch) -> None:
    with serve(api_key="s3cret") as url:
        args = ["trace", GPU, "--api", url, "-o", str(tmp_path / "t.json")]
        monkeypatch.delenv("FLARE_API_KEY", raising=False)
        r = runner.invoke(app, args)
        assert r.exit_code == 2 and "answered 401" in one_line(r.output)
        monkeypatch.setenv("FLARE_API_KEY", "s3cret")
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
