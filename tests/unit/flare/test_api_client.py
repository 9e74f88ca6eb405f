"""flare.api_client: the CLI's requests carry FLARE_API_KEY, so `flare incidents` reads a guarded
API (uvicorn on loopback over the sample store) with the key, and says in one line what to do
without it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from api import auth
from api.app import create_app
from flare.api_client import HEADER, api_client, api_headers, api_url, error_detail
from flare.cli import app
from flare.settings import Settings
from storage.testing import SAMPLE_JOB, MemoryStore, load_sample
from tests.live_api import served

KEY = "s3cr3t-key-for-tests"
runner = CliRunner()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("FLARE_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def guarded_api() -> Iterator[str]:
    store = MemoryStore()
    load_sample(store)
    with served(create_app(store, api_key=KEY)) as url:
        yield url


def test_the_header_is_the_one_the_api_reads() -> None:
    assert HEADER == auth.HEADER


def test_the_key_is_sent_only_when_set() -> None:
    assert api_headers(Settings()) == {}
    assert api_headers(Settings(api_key="")) == {}
    assert api_headers(Settings(api_key=KEY)) == {"X-API-Key": KEY}
    assert api_url(Settings(api_host="10.0.0.5", api_port=9000)) == "http://10.0.0.5:9000"
    assert api_url(Settings(), "http://flare:8000/") == "http://flare:8000"


def test_the_client_reads_a_guarded_api_with_the_key(guarded_api: str) -> None:
    with api_client(Settings(api_key=KEY), guarded_api) as client:
        assert client.get("/v1/jobs").status_code == 200
    with api_client(Settings(), guarded_api) as client:
        r = client.get("/v1/jobs")
    assert r.status_code == 401
    assert error_detail(r) == f"{auth.MISSING} (set FLARE_API_KEY to the API's key)"


def test_flare_incidents_sends_the_key_from_the_environment(guarded_api: str) -> None:
    r = runner.invoke(app, ["incidents", "--api", guarded_api, "--job", SAMPLE_JOB],
                      env={"FLARE_API_KEY": KEY})
    assert r.exit_code == 0, r.output
    assert len(r.stdout.splitlines()) == 2


@pytest.mark.parametrize("env", [{}, {"FLARE_API_KEY": "my-guess-123"}])
def test_flare_incidents_without_the_right_key_is_one_line_and_exit_2(
        guarded_api: str, env: dict[str, str]) -> None:
    r = runner.invoke(app, ["incidents", "--api", guarded_api], env=env)
    assert r.exit_code == 2
    (line,) = [ln for ln in r.output.splitlines() if ln.strip()]
    assert line.startswith(f"flare incidents: {guarded_api} answered 401: ")
    assert line.endswith("(set FLARE_API_KEY to the API's key)")
    assert "my-guess-123" not in r.output and KEY not in r.output


def test_an_error_that_is_not_a_problem_is_still_one_line() -> None:
    r = httpx.Response(502, text="<html>\n<b>bad gateway</b>\n</html>")
    assert error_detail(r) == "<html> <b>bad gateway</b> </html>"
    assert error_detail(httpx.Response(503)) == "Service Unavailable"
