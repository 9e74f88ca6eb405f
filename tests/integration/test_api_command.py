"""`flare api`: settings from FLARE_* / flags, DDL applied, the app served over ClickHouse."""

from __future__ import annotations

import os

import pytest
import typer
import uvicorn
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from flare.commands import api as api_command
from storage.client import connect
from storage.migrations import apply_schema
from storage.testing import load_sample
from storage.writer import Sink

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def cli() -> typer.Typer:
    app = typer.Typer()
    api_command.register(app)

    @app.command("other")
    def _other() -> None:  # a second command keeps `api` a subcommand, as in `flare`
        """Unused."""

    return app


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("FLARE_"):
            monkeypatch.delenv(name)


@pytest.mark.integration
def test_flare_api_serves_what_is_stored(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"chdb://{tmp_path / 'chdb'}"
    db = connect(url)
    apply_schema(db)
    load_sample(Sink(db))
    db.close()  # the command owns the engine from here on, as a separate process would
    seen: dict = {}

    def fake_run(app, host: str, port: int, log_level: str) -> None:
        client = TestClient(app)
        seen.update(host=host, port=port, log_level=log_level,
                    ready=client.get("/readyz").status_code,
                    jobs=[j["job"] for j in client.get("/v1/jobs").json()["items"]])

    monkeypatch.setattr(uvicorn, "run", fake_run)
    result = CliRunner().invoke(cli(), ["api", "--port", "8765"],
                                env={"FLARE_CLICKHOUSE_URL": url, "FLARE_LOG_LEVEL": "info"})
    assert result.exit_code == 0, result.output
    assert seen == {"host": "127.0.0.1", "port": 8765, "log_level": "info", "ready": 200,
                    "jobs": ["many", "quiet", "team/gpt-r7"]}


@pytest.mark.parametrize(
    ("url", "reason"),
    [("ftp://nowhere", "scheme must be chdb, http or https"),
     ("http://127.0.0.1:1/", "gave up after 0 s: cannot connect to ClickHouse at")],
)
def test_flare_api_exits_1_with_the_reason(
    url: str, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("must not serve"))
    result = CliRunner().invoke(cli(), ["api", "--clickhouse-url", url, "--wait", "0"])
    assert result.exit_code == 1
    assert "flare api: " in result.output and reason in result.output


@pytest.mark.integration
def test_flare_api_refuses_a_database_whose_migration_changed(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"chdb://{tmp_path / 'chdb'}"
    db = connect(url)
    apply_schema(db)
    db.command(f"INSERT INTO {db.table('schema_migrations')} (version, name, checksum)"
               " VALUES (20, '020_rank_steps.sql', 'not-what-shipped')")
    db.close()
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("must not serve"))
    result = CliRunner().invoke(cli(), ["api", "--clickhouse-url", url])
    assert result.exit_code == 1
    assert "020_rank_steps.sql" in result.output and "must not change" in result.output
