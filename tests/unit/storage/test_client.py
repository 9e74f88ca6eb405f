"""storage.client: URLs parsed and redacted, the connect retry policy on a fake clock, and
a server's ping and reads beside a statement that waits."""

from __future__ import annotations

import threading
from unittest.mock import create_autospec

import pytest
from clickhouse_connect.driver.httpclient import HttpClient
from pydantic import SecretStr

from schemas.testing import FakeClock
from storage.client import (
    PING_TIMEOUT_S,
    ClickHouse,
    StorageError,
    connect,
    connect_when_ready,
    parse_url,
)


@pytest.mark.parametrize(
    ("url", "path", "database"),
    [
        ("chdb:///var/lib/flare", "/var/lib/flare", "flare"),
        ("chdb:///./data/chdb", "./data/chdb", "flare"),
        ("chdb:///../x?database=other", "../x", "other"),
        ("chdb://:memory:", ":memory:", "flare"),
        ("chdb://memory", ":memory:", "flare"),
    ],
)
def test_parse_chdb_urls(url: str, path: str, database: str) -> None:
    parsed = parse_url(url)
    assert (parsed.scheme, parsed.path, parsed.database) == ("chdb", path, database)
    assert parsed.embedded


def test_parse_server_url_takes_password_from_settings_and_hides_it() -> None:
    parsed = parse_url("https://alice@ch.example:8443/prod", SecretStr("s3cret"))
    assert (parsed.host, parsed.port, parsed.username, parsed.database) == (
        "ch.example", 8443, "alice", "prod")
    assert parsed.password == "s3cret"
    assert "s3cret" not in repr(parsed) and "s3cret" not in parsed.redacted()
    assert parse_url("http://bob:pw@h/").password == "pw"  # the URL's own password wins
    assert parse_url("http://h").database == "flare"


@pytest.mark.parametrize(
    "url",
    ["ftp://h/db", "chdb://relative/path", "http:///db", "http://h/bad-name", "http://h:99999/",
     "clickhouse.example:8123", ""],
)
def test_bad_urls_say_why(url: str) -> None:
    with pytest.raises(ValueError, match="ClickHouse URL"):
        parse_url(url)


def test_connect_when_ready_retries_on_a_fake_clock_then_gives_up() -> None:
    clock = FakeClock(start_ns=0)
    with pytest.raises(StorageError, match="gave up after 3 s"):
        connect_when_ready("http://127.0.0.1:1/", timeout_s=3, interval_s=1,
                           now=clock.seconds, sleep=clock.sleep)
    assert clock.sleeps == [1, 1, 1]
    with pytest.raises(ValueError):  # a malformed URL fails at once
        connect_when_ready("nope://", now=clock.seconds, sleep=clock.sleep)
    assert len(clock.sleeps) == 3


def test_a_server_is_pinged_beside_a_statement_that_waits_for_it() -> None:
    """A write waiting on a server that does not answer holds the client's lock; the
    readiness probe's ping must not queue behind it (nor hold up its retry)."""
    client = create_autospec(HttpClient, spec_set=True, instance=True)
    answer = threading.Event()
    client.insert_arrow.side_effect = lambda *_args: answer.wait(30)
    client.ping.return_value = False  # the server does not answer its /ping either
    db = ClickHouse(client, "flare", "http://ch:8123/flare", server=True)
    write = threading.Thread(target=db.insert_arrow, args=("flare.t", None))
    write.start()
    try:
        pinged: list[bool] = []
        probe = threading.Thread(target=lambda: pinged.append(db.ping()))
        probe.start()
        probe.join(30)
        assert pinged == [False] and write.is_alive()  # answered while the write waits
        client.ping.assert_called_once_with(timeout=PING_TIMEOUT_S)
    finally:
        answer.set()
        write.join(30)


def _beside_a_waiting_write(server: bool) -> tuple[list[int], bool]:
    """A read started while a write waits on ClickHouse: what it returned within 2 s, and
    whether the write was still waiting then."""
    client = create_autospec(HttpClient, spec_set=True, instance=True)
    answer = threading.Event()
    client.insert_arrow.side_effect = lambda *_args: answer.wait(30)
    client.query.return_value.column_names = ("n",)
    client.query.return_value.result_rows = [(7,)]
    db = ClickHouse(client, "flare", "http://ch:8123/flare" if server else "chdb://memory",
                    server=server)
    write = threading.Thread(target=db.insert_arrow, args=("flare.t", None))
    write.start()
    try:
        read: list[int] = []
        reader = threading.Thread(target=lambda: read.extend(r["n"] for r in db.rows("x")))
        reader.start()
        reader.join(2)
        return list(read), write.is_alive()
    finally:
        answer.set()
        write.join(30)
        reader.join(30)


def test_a_servers_reads_answer_beside_a_write_that_waits_for_it() -> None:
    """The worker's `/v1` reads share its client with the writes: while a write waits on a
    server that does not answer (up to the read timeout), they must not queue behind it."""
    assert _beside_a_waiting_write(server=True) == ([7], True)


def test_the_embedded_engine_runs_one_statement_at_a_time() -> None:
    assert _beside_a_waiting_write(server=False) == ([], True)


def test_a_servers_client_keeps_no_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """ClickHouse runs one statement at a time per session: reads side by side with a write
    need a client without one."""
    import clickhouse_connect

    seen: dict[str, object] = {}
    monkeypatch.setattr(clickhouse_connect, "get_client", lambda **kw: seen.update(kw))
    connect("http://default@ch:8123/flare")
    assert seen["autogenerate_session_id"] is False and seen["host"] == "ch"


def test_timeouts_are_whole_seconds_of_at_least_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        connect("http://127.0.0.1:1/", connect_timeout_s=0)
