"""`flare incidents` against a real API server (uvicorn on loopback) over the sample store."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest
from typer.testing import CliRunner

from api.app import create_app
from flare.cli import app
from flare.local.broker import free_port
from storage.testing import SAMPLE_JOB, MemoryStore, load_sample
from tests.live_api import served

runner = CliRunner()


@pytest.fixture(scope="module")
def api_url() -> Iterator[str]:
    store = MemoryStore()
    load_sample(store)
    with served(create_app(store)) as url:
        yield url


def test_incidents_are_listed_newest_first_and_filtered(api_url: str) -> None:
    r = runner.invoke(app, ["incidents", "--api", api_url, "--job", SAMPLE_JOB])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and "rank:1" in lines[0] and "node:node-1" in lines[1]
    assert "open" in lines[0] and "costs" in lines[0]
    r = runner.invoke(app, ["incidents", "--api", api_url, "--status", "resolved", "--json",
                            "--limit", "3"])
    items = orjson.loads(r.stdout)
    assert len(items) == 3 and {i["status"] for i in items} == {"resolved"}


def test_bad_values_and_a_missing_api_are_one_line_and_exit_2(api_url: str) -> None:
    r = runner.invoke(app, ["incidents", "--api", api_url, "--kind", "bogus"])
    assert r.exit_code == 2 and "gpu, node" in r.output
    r = runner.invoke(app, ["incidents", "--api", f"http://127.0.0.1:{free_port()}"])
    assert r.exit_code == 2
    (line,) = [ln for ln in r.output.splitlines() if ln.strip()]
    assert line.startswith("flare incidents: no API at http://127.0.0.1:")
