"""The one seam between Flare and ClickHouse: a client built from a URL, behind a lock.

`FLARE_CLICKHOUSE_URL` names either the embedded engine (`chdb:///path`) or a server
(`http(s)://user@host:port/db`); everything above this module (schema, sink, queries) sees
the same small `ClickHouse` object and never clickhouse-connect itself. Every call to the
embedded engine holds a lock because chDB is one in-process engine and FastAPI runs sync
endpoints in worker threads. A server's client keeps no session (a session runs one statement
at a time), so its calls run side by side on pooled connections: a read answers while a write
waits on a server that does not answer, and fails by its own timeout if the server is gone.
Driver exceptions become `StorageError`, so callers catch one type (the API answers 503).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pyarrow as pa  # type: ignore[import-untyped]  # ships no type information
from pydantic import SecretStr

from schemas.redact import redact_url

DEFAULT_DATABASE = "flare"
# How long a server may take, by default (FLARE_CLICKHOUSE_CONNECT_TIMEOUT_S and
# FLARE_CLICKHOUSE_READ_TIMEOUT_S set them): a host that drops packets holds a call for the
# connect timeout (twice: the HTTP client retries a connect once), a server that accepts and
# never answers for the read timeout. clickhouse-connect's own are 10 s and 300 s.
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 30
# A ping is a probe's question: it must answer within the probe's own patience (Kubernetes
# waits 1 s by default) whatever a statement in flight is waiting for. The driver retries a
# failed connect once, so a ping that gets no answer takes twice this.
PING_TIMEOUT_S = 0.5
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MEMORY = ("", "memory", ":memory:")


class StorageError(RuntimeError):
    """ClickHouse did not answer, or refused a statement; says which and why."""


@dataclass(frozen=True, slots=True)
class ClickHouseURL:
    """A parsed `FLARE_CLICKHOUSE_URL`; the password never shows in reprs or logs."""

    scheme: str  # chdb | http | https
    database: str
    path: str = ":memory:"  # chdb only: data directory or :memory:
    host: str = ""
    port: int | None = None
    username: str | None = None
    password: str = field(default="", repr=False)

    @property
    def embedded(self) -> bool:
        return self.scheme == "chdb"

    def redacted(self) -> str:
        """The URL as safe to print (no password)."""
        if self.embedded:
            if self.path == ":memory:":
                return "chdb://:memory:"
            return f"chdb://{self.path}" if self.path.startswith("/") else f"chdb:///{self.path}"
        user = f"{self.username}@" if self.username else ""
        port = f":{self.port}" if self.port else ""
        return f"{self.scheme}://{user}{self.host}{port}/{self.database}"


def _bad(url: str, why: str) -> ValueError:
    """A malformed URL, named without its password: the message reaches the terminal."""
    return ValueError(f"ClickHouse URL {redact_url(url)!r}: {why}")


def _database(name: str | None, url: str) -> str:
    name = name or DEFAULT_DATABASE
    if not _IDENT.match(name):
        raise _bad(url, f"database {name!r} is not a plain identifier")
    return name


def parse_url(url: str, password: str | SecretStr | None = None) -> ClickHouseURL:
    """Parse `chdb:///abs/path`, `chdb:///./relative/path`, `chdb://:memory:` or
    `http(s)://user[:password]@host[:port][/database]`.

    For chdb the database comes from `?database=name` (the path is the data directory). The
    password is the URL's if it has one, else `password` (FLARE_CLICKHOUSE_PASSWORD).
    """
    secret = password.get_secret_value() if isinstance(password, SecretStr) else password or ""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if parts.scheme == "chdb":
        if parts.netloc in _MEMORY and parts.path in ("", "/"):
            path = ":memory:"
        elif parts.netloc:
            raise _bad(url, "use chdb:///absolute/path, chdb:///./relative/path or "
                       "chdb://:memory: (three slashes before a path)")
        else:
            path = unquote(parts.path)
            if path.startswith(("/./", "/../")):
                path = path[1:]
        return ClickHouseURL("chdb", _database(query.get("database", [None])[0], url), path=path)
    if parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise _bad(url, "no host")
        try:
            port = parts.port
        except ValueError as exc:
            raise _bad(url, str(exc)) from None
        db = unquote(parts.path.strip("/")) or None
        return ClickHouseURL(
            parts.scheme,
            _database(db, url),
            host=parts.hostname,
            port=port,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else secret,
        )
    raise _bad(url, "scheme must be chdb, http or https "
               "(e.g. chdb:///./data/chdb or http://default@localhost:8123/flare)")


class ClickHouse:
    """A clickhouse-connect client, its lock and the Flare database name.

    Queries name tables through `table()` (`database.name`), so the client needs no default
    database and can exist before `CREATE DATABASE` ran.
    """

    def __init__(self, client: Any, database: str, location: str, *,
                 server: bool = False) -> None:
        self._client = client
        self._lock = threading.RLock()
        self.database = database
        self.location = location
        self._server = server  # reached over HTTP, with no session: no lock (module doc)

    def __repr__(self) -> str:
        return f"ClickHouse({self.location!r}, database={self.database!r})"

    def table(self, name: str) -> str:
        """The qualified name of one of Flare's tables or views."""
        return f"{self.database}.{name}"

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn` on the client, under the lock for the embedded engine (module doc)."""
        from clickhouse_connect.driver.exceptions import ClickHouseError

        with contextlib.nullcontext() if self._server else self._lock:
            try:
                return fn()
            except (ClickHouseError, OSError) as exc:
                raise StorageError(f"ClickHouse at {self.location}: {what} failed: {exc}") from exc

    def command(self, sql: str, parameters: Mapping[str, Any] | None = None) -> None:
        """A statement without a result (DDL)."""
        self._call("command", lambda: self._client.command(sql, parameters=parameters))

    def rows(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """A query's rows as dicts keyed by column name."""
        result = self._call("query", lambda: self._client.query(sql, parameters=parameters))
        names = result.column_names
        return [dict(zip(names, row, strict=True)) for row in result.result_rows]

    def columns(self, sql: str, parameters: Mapping[str, Any] | None = None) -> dict[str, list]:
        """A query's result as one list per column (for series)."""
        result = self._call("query", lambda: self._client.query(sql, parameters=parameters))
        cols = result.result_columns
        if not cols:
            cols = [[] for _ in result.column_names]
        return dict(zip(result.column_names, cols, strict=True))

    def insert_arrow(self, table: str, data: pa.Table) -> None:
        """One INSERT of a whole Arrow table (columns by name; missing ones take DEFAULT)."""
        self._call(f"insert into {table}", lambda: self._client.insert_arrow(table, data))

    def ping(self) -> bool:
        """True when the engine answers a trivial query, or the server its `/ping`.

        A server is asked over a connection of its own, within PING_TIMEOUT_S and without the
        lock: a probe must answer promptly even while a write waits (up to the read timeout)
        on a server that does not answer, and queued pings must not hold up that write's
        retry. (`/ping` says the server is up; a statement that fails says the rest.)"""
        if self._server:
            try:
                return bool(self._client.ping(timeout=PING_TIMEOUT_S))
            except Exception:  # the driver answers False for network errors; anything else too
                return False
        try:
            self._call("ping", lambda: self._client.command("SELECT 1"))
        except StorageError:
            return False
        return True

    def close(self) -> None:
        """Release the client (for chDB this frees the engine for another data directory)."""
        with self._lock:
            self._client.close()

    def __enter__(self) -> ClickHouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(url: str, password: str | SecretStr | None = None, *,
            connect_timeout_s: int = CONNECT_TIMEOUT_S,
            read_timeout_s: int = READ_TIMEOUT_S) -> ClickHouse:
    """Build the client a URL names. chDB creates its data directory if needed.

    For a server, `connect_timeout_s` bounds opening a connection and `read_timeout_s` each
    wait for the server's next bytes (whole seconds: the driver truncates to int). The read
    timeout is meant as no limit on a statement's length: clickhouse-connect asks the server
    for progress headers every max(10, read - 5) s, so with 15 s or more a long statement
    keeps its connection busy and only a server that stopped answering reaches the timeout
    (the driver's design, not measured here: the test machines have no ClickHouse server).
    """
    import clickhouse_connect

    if connect_timeout_s < 1 or read_timeout_s < 1:
        raise ValueError("ClickHouse timeouts are whole seconds, at least 1")

    parsed = parse_url(url, password)
    try:
        if parsed.embedded:
            if parsed.path != ":memory:":
                Path(parsed.path).mkdir(parents=True, exist_ok=True)
            client = clickhouse_connect.get_client(interface="chdb", path=parsed.path)
        else:
            client = clickhouse_connect.get_client(
                interface=parsed.scheme,
                host=parsed.host,
                port=parsed.port or (8443 if parsed.scheme == "https" else 8123),
                username=parsed.username or "default",
                password=parsed.password,
                secure=parsed.scheme == "https",
                connect_timeout=connect_timeout_s,
                send_receive_timeout=read_timeout_s,
                autogenerate_session_id=False,  # statements side by side (module doc)
            )
    except Exception as exc:  # any driver or socket failure while connecting
        raise StorageError(f"cannot connect to ClickHouse at {parsed.redacted()}: {exc}") from exc
    return ClickHouse(client, parsed.database, parsed.redacted(), server=not parsed.embedded)


def connect_when_ready(
    url: str,
    password: str | SecretStr | None = None,
    *,
    timeout_s: float = 30.0,
    interval_s: float = 1.0,
    now: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    connect_timeout_s: int = CONNECT_TIMEOUT_S,
    read_timeout_s: int = READ_TIMEOUT_S,
) -> ClickHouse:
    """Connect, retrying until `timeout_s`: a server started next to us may still be booting.

    Time is an input (`now`, `sleep`) so the retry policy is tested without waiting. The
    client's own timeouts are `connect`'s.
    """
    parse_url(url, password)  # a malformed URL fails at once, not after the timeout
    deadline = now() + timeout_s
    while True:
        try:
            db = connect(url, password, connect_timeout_s=connect_timeout_s,
                         read_timeout_s=read_timeout_s)
            if db.ping():
                return db
            db.close()
            last = f"ClickHouse at {db.location} does not answer"
        except StorageError as exc:
            last = str(exc)
        if now() >= deadline:
            raise StorageError(f"gave up after {timeout_s:g} s: {last}")
        sleep(interval_s)
