"""Ad-hoc SQL for the on-call: one read-only statement, bounded, on a session of its own.

`flare sql` and `POST /v1/sql` run whatever an SRE types against Flare's ClickHouse, so the
protection cannot depend on the text looking harmless. It comes in layers:

1. ClickHouse's own read-only mode. The session runs with `readonly = 1`, set after the
   limits (chDB: a handle of its own on the worker's engine, set once; a server: sent with
   every request). No statement can write, create, drop, alter, or change a setting, the
   limits included, whether by `SET` or by the statement's own `SETTINGS` clause; table
   functions that reach outside (file, url, s3, remote, filesystem, ...) are refused too.
2. Limits the engine enforces: result rows and bytes (`break`: the first rows come back,
   marked truncated), seconds, memory and threads, so a query cannot starve the worker that
   shares the engine.
3. ClickHouse parses the text first (`formatQuery`, the text passed as a bound parameter):
   one statement, or a refusal. What runs is that canonical text, so what was checked is
   exactly what runs.
4. The statement must be a read (SELECT, WITH, SHOW, DESCRIBE, EXISTS, EXPLAIN): read-only
   mode still allows KILL QUERY, which could kill the worker's own inserts, and USE.
5. Two holes read-only mode leaves in the embedded engine (chDB is clickhouse-local, where
   these are client features, tested in tests/integration/test_sql.py): `INTO OUTFILE`
   writes a file, and the `file()` function reads any file the process can read (its
   environment too, through /proc). Both are refused, the function by its name in the
   statement's AST (`EXPLAIN AST`), as is chDB's `python()` table function, which looks up
   objects of the engine's process by name before read-only mode refuses it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import msgspec
from pydantic import SecretStr

from storage.client import StorageError, parse_url

READS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "EXISTS", "EXPLAIN")
REFUSED_FUNCTIONS = {  # by lower-case name: table functions match whatever the case
    "file": "file() reads files on the host",
    "python": "python() reads objects of the process that runs the engine",
}
_READONLY = 164  # ClickHouse's error code READONLY
_LITERALS = re.compile(r"'(?:[^'\\]|\\.)*'|`(?:[^`\\]|\\.)*`", re.S)  # canonical quoting
_OUTFILE = re.compile(r"\bINTO\s+OUTFILE\b", re.I)
_FORMAT = re.compile(r"^FORMAT\b", re.M)  # a top-level clause starts a canonical line
_FUNCTION = re.compile(r"^\s*Function (\S+)")  # a line of EXPLAIN AST
_IN_SCOPE = re.compile(r":? In scope SELECT formatQuery\(.*", re.S)
_MESSAGE = re.compile(r"Code: \d+\. DB::\w*Exception: (.*)", re.S)
_VERSION = re.compile(r"\s*\(version [^)]*\)")
_MAX_DETAIL = 600


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What one statement may take. `json_bytes` bounds the answer as JSON; the engine's own
    byte limit is 8× that, a backstop that only a result mostly of empty values could reach
    before the JSON budget does, so `truncated` stays exact in practice."""

    rows: int = 10_000
    json_bytes: int = 16 * 2**20
    seconds: int = 30
    memory_bytes: int = 2**30
    threads: int = 2

    def settings(self) -> dict[str, Any]:
        """The session's settings, in the order they must be applied: `readonly` last,
        since after it no setting may change."""
        return {
            "max_result_rows": self.rows,
            "max_result_bytes": 8 * self.json_bytes,
            "result_overflow_mode": "break",
            "max_execution_time": self.seconds,
            "max_memory_usage": self.memory_bytes,
            "max_threads": self.threads,
            "readonly": 1,
        }


class SQLRefused(ValueError):
    """A statement that was not run, or that ClickHouse refused (syntax, unknown table, a
    limit); the message says why. `forbidden`: refused because it is not a read."""

    def __init__(self, message: str, *, forbidden: bool = False) -> None:
        super().__init__(message)
        self.forbidden = forbidden


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """A statement's result: (name, ClickHouse type) per column, rows of JSON-ready values,
    and whether rows were left out by the limits (`max_rows` is the row limit)."""

    columns: list[tuple[str, str]]
    rows: list[list[Any]]
    truncated: bool
    max_rows: int


def plain(value: Any) -> Any:
    """A value as JSON can carry it: times in ISO 8601, decimals, UUIDs and addresses as
    text, NaN and infinities as null (as ClickHouse's own JSON output), bytes as UTF-8 with
    anything else escaped."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, Mapping):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if isinstance(value, Decimal | timedelta):
        return str(value)
    return str(value)  # UUID, IPv4Address, IPv6Address and any other scalar


class ReadOnlySQL:
    """Runs one read-only statement at a time on its own ClickHouse session (see the module
    docstring). `per_query` are settings sent with every request (a server's HTTP interface
    keeps no session); an embedded session has them set once."""

    def __init__(self, client: Any, location: str, limits: Limits,
                 per_query: Mapping[str, Any] | None = None) -> None:
        self._client = client
        self._per_query = dict(per_query) if per_query else None
        self.location = location
        self.limits = limits

    def __repr__(self) -> str:
        return f"ReadOnlySQL({self.location!r})"

    def run(self, sql: str) -> Answer:
        """Check `sql` and run it: SQLRefused if it is not one read or ClickHouse refuses
        it, StorageError if ClickHouse cannot be reached."""
        result = self._query("SELECT formatQuery({q:String})", {"q": sql})
        canonical = str(result.result_rows[0][0])
        kind = canonical.split(None, 1)[0].upper()
        if kind not in READS:
            raise SQLRefused(f"read-only: {kind} is not a read; only {', '.join(READS)} "
                             "statements run here", forbidden=True)
        bare = _LITERALS.sub("''", canonical)
        if _OUTFILE.search(bare):
            raise SQLRefused("read-only: INTO OUTFILE would write a file", forbidden=True)
        if _FORMAT.search(bare):
            raise SQLRefused("leave out FORMAT: the rows come back as JSON")
        tree = self._query(f"EXPLAIN AST {canonical}")
        for (line,) in tree.result_rows:
            m = _FUNCTION.match(str(line))
            why = REFUSED_FUNCTIONS.get(m.group(1).lower()) if m else None
            if why:
                raise SQLRefused(f"read-only: {why}", forbidden=True)
        return self._answer(self._query(canonical))

    def _answer(self, result: Any) -> Answer:
        columns = [(str(n), t.name) for n, t in
                   zip(result.column_names, result.column_types, strict=True)]
        rows: list[list[Any]] = []
        size = 2
        truncated = False
        for row in result.result_rows:
            values = [plain(v) for v in row]
            size += len(msgspec.json.encode(values)) + 1
            if len(rows) == self.limits.rows or size > self.limits.json_bytes:
                truncated = True
                break
            rows.append(values)
        return Answer(columns, rows, truncated, self.limits.rows)

    def _query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> Any:
        from clickhouse_connect.driver.exceptions import ClickHouseError, OperationalError

        try:
            return self._client.query(sql, parameters=parameters, settings=self._per_query)
        except OperationalError as exc:
            raise StorageError(f"ClickHouse at {self.location}: query failed: {exc}") from exc
        except ClickHouseError as exc:
            code = getattr(exc, "code", None)
            if not code:
                raise StorageError(f"ClickHouse at {self.location}: {exc}") from exc
            raise SQLRefused(_reason(exc), forbidden=code == _READONLY) from None

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ReadOnlySQL:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reason(exc: Exception) -> str:
    """ClickHouse's own message, without the driver's wrapping, the formatQuery call that
    parsed the text, or a server's version trailer."""
    message = str(exc)
    while m := _MESSAGE.search(message):  # a nested exception repeats the prefix
        message = m.group(1)
    message = _VERSION.sub("", _IN_SCOPE.sub("", message))
    name = getattr(exc, "name", None)
    if name:
        message = message.replace(f"({name})", "").rstrip(" .") + f". ({name})"
    message = message.strip()
    if len(message) > _MAX_DETAIL:
        message = message[:_MAX_DETAIL] + "…"
    return f"ClickHouse: {message}"


def open_readonly(url: str, password: str | SecretStr | None = None,
                  limits: Limits | None = None) -> ReadOnlySQL:
    """A read-only session on the ClickHouse a URL names (storage.client.parse_url), its
    default database Flare's. For chDB it is a second handle on the engine of this process
    (chDB runs queries of several handles concurrently), so the worker that owns the data
    directory serves it; `StorageError` when it cannot be opened."""
    import clickhouse_connect

    limits = limits or Limits()
    parsed = parse_url(url, password)
    try:
        if parsed.embedded:
            if parsed.path != ":memory:":
                Path(parsed.path).mkdir(parents=True, exist_ok=True)
            client = clickhouse_connect.get_client(
                interface="chdb", path=parsed.path, database=parsed.database,
                show_clickhouse_errors="scrub", tz_mode="aware")
            try:
                for name, value in limits.settings().items():
                    client.command(f"SET {name} = {value!r}")
            except Exception:
                client.close()
                raise
            return ReadOnlySQL(client, parsed.redacted(), limits)
        client = clickhouse_connect.get_client(
            interface=parsed.scheme, host=parsed.host,
            port=parsed.port or (8443 if parsed.scheme == "https" else 8123),
            username=parsed.username or "default", password=parsed.password,
            database=parsed.database, secure=parsed.scheme == "https",
            show_clickhouse_errors="scrub", tz_mode="aware")
    except Exception as exc:  # any driver or socket failure while connecting
        raise StorageError(f"cannot open a read-only session on ClickHouse at "
                           f"{parsed.redacted()}: {exc}") from exc
    return ReadOnlySQL(client, parsed.redacted(), limits, per_query=limits.settings())
