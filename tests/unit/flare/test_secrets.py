"""Secrets never show: not in the settings' repr or str, not in the one line a command prints
when ClickHouse is unreachable or its URL is malformed, not in the alerts' logs and counters
(a webhook's token is its path), not in httpx's own request log."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import uvicorn
from typer.testing import CliRunner

from flare.cli import app
from flare.settings import Settings
from schemas.testing import FakeClock
from storage.client import parse_url
from storage.testing import make_incident
from streams.alerts import AlertTargets, Notifier, httpx_post

SECRETS = {
    "FLARE_CLICKHOUSE_PASSWORD": "ch-env-Pw-1",
    "FLARE_KAFKA_SASL_PASSWORD": "sasl-Pw-2",
    "FLARE_KAFKA_SSL_KEY_PASSWORD": "tls-Pw-3",
    "FLARE_API_KEY": "api-Key-4",
}
URL_SECRETS = {  # secrets that ride inside URLs, and the URLs
    "ch-url-Pw-5": ("FLARE_CLICKHOUSE_URL", "http://flare:ch-url-Pw-5@clickhouse:8123/flare"),
    "am-Pw-6": ("FLARE_ALERTMANAGER_URL", "https://oncall:am-Pw-6@am.example:9093"),
    "hook-Tok-7": ("FLARE_WEBHOOK_URL", "https://hooks.example/services/T0/hook-Tok-7"),
}


def assert_no_secret(text: str) -> None:
    for secret in [*SECRETS.values(), *URL_SECRETS]:
        assert secret not in text, f"{secret!r} leaked in: {text}"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("FLARE_"):
            monkeypatch.delenv(name)


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    for name, url in URL_SECRETS.values():
        monkeypatch.setenv(name, url)


@pytest.mark.usefixtures("secret_env")
def test_the_settings_repr_and_str_hide_every_secret_yet_keep_the_values() -> None:
    settings = Settings()
    for text in (repr(settings), str(settings), f"{settings}", f"{settings!r}"):
        assert_no_secret(text)
        assert "clickhouse_url='http://flare@clickhouse:8123/flare'" in text
        assert "webhook_url='https://hooks.example/…'" in text
        assert "alertmanager_url='https://am.example:9093'" in text
    # what the process uses is untouched
    assert settings.clickhouse_url == URL_SECRETS["ch-url-Pw-5"][1]
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "api-Key-4"
    conn = settings.kafka_connection()
    assert_no_secret(repr(conn))


@pytest.mark.parametrize("url", [
    "http://flare:ch-url-Pw-5@clickhouse:notaport/flare",
    "http://flare:ch-url-Pw-5@/flare",
    "ftp://flare:ch-url-Pw-5@clickhouse/flare",
    "http://flare:ch-url-Pw-5@clickhouse/not-a-db-name",
])
def test_a_malformed_clickhouse_url_is_named_without_its_password(url: str) -> None:
    with pytest.raises(ValueError, match="ClickHouse URL 'http|ClickHouse URL 'ftp") as err:
        parse_url(url)
    assert_no_secret(str(err.value))
    assert "flare@" in str(err.value)


@pytest.mark.usefixtures("secret_env")
@pytest.mark.parametrize("url", ["http://flare:ch-url-Pw-5@127.0.0.1:1/flare",
                                 "http://flare:ch-url-Pw-5@127.0.0.1:bad/flare"])
def test_flare_api_names_an_unreachable_or_bad_clickhouse_without_secrets(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("must not serve"))
    result = CliRunner().invoke(app, ["api", "--wait", "0"], env={"FLARE_CLICKHOUSE_URL": url})
    assert result.exit_code == 1
    assert "flare api: " in result.output and "http://flare@127.0.0.1:" in result.output
    assert_no_secret(result.output)


class Refusing:
    """An HTTP seam that fails the way httpx can, naming the URL in its message."""

    def __init__(self, status: int | None = None) -> None:
        self.status = status

    async def __call__(self, url: str, body: bytes) -> int:
        if self.status is None:
            raise ConnectionError(f"cannot reach {url}")
        return self.status


@pytest.mark.parametrize("post", [Refusing(), Refusing(503)])
def test_alert_failures_are_logged_and_counted_without_the_receivers_credentials(
        post: Refusing, caplog: pytest.LogCaptureFixture) -> None:
    targets = AlertTargets(alertmanager_url=URL_SECRETS["am-Pw-6"][1],
                           webhook_url=URL_SECRETS["hook-Tok-7"][1])
    notifier = Notifier(targets, post, FakeClock())
    with caplog.at_level(logging.DEBUG):
        asyncio.run(notifier.notify([make_incident("j")]))
    assert notifier.stats.failed == 1 and notifier.stats.webhook_failed == 1
    logged = caplog.text
    assert "https://hooks.example/…" in logged and "https://am.example:9093/…" in logged
    assert_no_secret(logged + notifier.stats.last_error)


class _Hook(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hook_server() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    thread.join(5)


def test_the_real_http_seam_logs_no_webhook_url_at_info(
        hook_server: int, caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://user:hook-Tok-7@127.0.0.1:{hook_server}/services/hook-Tok-7"
    post = httpx_post()
    with caplog.at_level(logging.INFO):
        assert asyncio.run(post(url, b"{}")) == 200
    assert_no_secret(caplog.text)
    assert logging.getLogger("httpx").getEffectiveLevel() >= logging.WARNING
