"""A ClickHouse HTTP interface over the embedded engine (chDB), for reliability tests.

    python load-tests/chdb_http.py --path DIR [--port 8123] [--host 127.0.0.1] [--scratch DIR]
        [--verbose]

Why it exists: the test machines have no ClickHouse server, only the embedded engine (chDB,
from `clickhouse-connect[chdb]`; Debian's clickhouse-server is 18.16, too old for Flare's
DDL), and an embedded engine cannot be taken away from the process that embeds it. A worker
pointed at this front (`FLARE_CLICKHOUSE_URL=http://default@127.0.0.1:PORT/flare`) talks to
ClickHouse exactly as in production, through clickhouse-connect's HTTP client, while the
real engine owns the data directory in this separate process: stopping the process is a
ClickHouse outage, starting it again on the same directory is the recovery, and freezing it
(SIGSTOP, then SIGCONT) is a ClickHouse that hangs: connections accepted by the kernel and
never answered (`reliability_storage_outage.py`). It prints one line once it listens.

What it does, as a ClickHouse server's HTTP interface does (written from that interface's
documentation and from what clickhouse-connect 1.12 sends):
- `GET /` and `GET /ping` answer "Ok.";
- a statement comes in the `query` URL parameter, in the body, or begun in the one and
  continued in the other (joined by a newline); a GET runs it with `readonly = 2`;
- server-side parameters (`param_<name>=value` for `{name:Type}`) come as URL parameters or
  as fields of a multipart/form-data body (clickhouse-connect's form encoding of long ones);
- `database`, and every other URL parameter that is not the transport's own, apply to the
  statement as its default database and settings: each distinct set gets an engine handle
  of its own (USE, then SET of each, `readonly` last), so nothing leaks between requests;
- `INSERT INTO ... FORMAT <fmt>` followed by data in the body (Arrow from `insert_arrow`,
  Native from `insert`): the data reaches the engine from a scratch file (`FROM INFILE`);
  a body sent with `Content-Encoding` gzip, deflate or lz4 is decoded first;
- a result comes in the statement's `FORMAT` (else `default_format`, else TabSeparated),
  with `X-ClickHouse-Format`, `X-ClickHouse-Query-Id` and `X-ClickHouse-Summary`; an error
  as ClickHouse answers one: status 500, `X-ClickHouse-Exception-Code` and the exception's
  text as the body, so the client raises.

What it does not do: authentication (any user and password are accepted), sessions
(`session_id` is ignored: a `SET` or `USE` lasts one request), response compression (answers are
never compressed, which `Accept-Encoding` allows), progress headers, streaming (a result is
sent whole, as with `wait_end_of_query=1`), cancelling a query, external data tables,
ClickHouse's own compressed body format (`decompress=1`), zstd or brotli bodies, TLS, the
native TCP protocol, and running two statements at once (one lock serializes the engine,
as `storage/client.py` does in a process that embeds it).
"""

from __future__ import annotations

import argparse
import email.parser
import email.policy
import gzip
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

# URL parameters about the HTTP exchange itself, never settings of the statement.
TRANSPORT = frozenset({
    "query", "database", "default_format", "query_id", "user", "password", "quota_key",
    "session_id", "session_timeout", "session_check", "compress", "decompress", "buffer_size",
    "wait_end_of_query", "client_protocol_version", "role", "enable_http_compression",
    "send_progress_in_http_headers", "http_headers_progress_interval_ms",
    "cancel_http_readonly_queries_on_client_close",
})
PARAM_PREFIX = "param_"
DEFAULT_FORMAT = "TabSeparated"
MAX_HANDLES = 16  # engine handles kept, one per (database, settings); Flare uses three or four
# ClickHouse's own error codes for what this front refuses before the engine sees it.
NOT_IMPLEMENTED = 48
UNKNOWN_SETTING = 115
CANNOT_DECOMPRESS = 271
UNKNOWN_EXCEPTION = 1002

_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FORMAT_NAME = re.compile(rb"^[A-Za-z0-9_]+$")
_CODE = re.compile(r"Code: (\d+)\.")
# The head of an INSERT whose data follows in the body: up to `FORMAT <name>` and one line
# end. A head with VALUES or SELECT carries its rows itself and runs as it is.
_INSERT_HEAD = re.compile(rb"\A\s*(INSERT\s+INTO\s+.+?)\s+FORMAT\s+(\w+)[ \t]*(?:\r?\n)?",
                          re.IGNORECASE | re.DOTALL)
_ROWS_IN_HEAD = re.compile(rb"\b(VALUES|SELECT)\b", re.IGNORECASE)
_SETTINGS_IN_HEAD = re.compile(rb"\s+SETTINGS\s+(.*)\Z", re.IGNORECASE | re.DOTALL)
_TRAILING_FORMAT = re.compile(rb"\bFORMAT\s+(\w+)\s*;?\s*\Z", re.IGNORECASE)
_SESSION_STATE = re.compile(rb"\A\s*(SET|USE)\b", re.IGNORECASE)  # lasts one request here
_READS = re.compile(rb"\A\s*(SELECT|WITH|SHOW|DESCRIBE|DESC|EXISTS|EXPLAIN)\b", re.IGNORECASE)
_CONTENT_TYPES = {
    "Native": "application/octet-stream", "RowBinary": "application/octet-stream",
    "Arrow": "application/octet-stream", "Parquet": "application/octet-stream",
    "JSON": "application/json; charset=UTF-8", "JSONEachRow": "application/x-ndjson",
}

Settings = tuple[tuple[str, str], ...]


class Refused(Exception):
    """A statement not run, or run and refused: ClickHouse's error code and its text."""

    def __init__(self, code: int, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


@dataclass(frozen=True, slots=True)
class Statement:
    """One request, as the engine will run it."""

    text: bytes  # the statement, and for an INSERT ... FORMAT its data after the head
    database: str = ""
    settings: Settings = ()
    params: dict[str, str] = field(default_factory=dict)  # bare names (no `param_`)
    default_format: str = DEFAULT_FORMAT
    query_id: str = ""


@dataclass(frozen=True, slots=True)
class InsertData:
    """An INSERT whose rows follow its head in the body."""

    head: bytes  # INSERT INTO table (columns), without its SETTINGS
    settings: bytes  # the head's SETTINGS clause, if any (it goes after FROM INFILE)
    fmt: str
    data: bytes


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a statement returned: its output, the output's format (None for a statement
    that returns no result set) and the figures of `X-ClickHouse-Summary`."""

    body: bytes
    fmt: str | None
    summary: dict[str, str]


# -- requests ---------------------------------------------------------------------------------


def decode_body(body: bytes, encoding: str) -> bytes:
    """The body without its `Content-Encoding` (gzip, deflate, lz4 frame); Refused for
    another one."""
    encoding = encoding.strip().lower()
    try:
        if encoding in ("", "identity"):
            return body
        if encoding == "gzip":
            return gzip.decompress(body)
        if encoding == "deflate":
            return zlib.decompress(body)
        if encoding == "lz4":
            import lz4.frame  # type: ignore[import-untyped]  # clickhouse-connect's own codec

            return bytes(lz4.frame.decompress(body))
    except Exception as exc:
        raise Refused(CANNOT_DECOMPRESS, f"cannot decode a {encoding} body: {exc}",
                      400) from None
    raise Refused(NOT_IMPLEMENTED, f"Content-Encoding {encoding!r} is not supported by this "
                  "test front", 501)


def form_fields(content_type: str, body: bytes) -> dict[str, str]:
    """The fields of a multipart/form-data body (the query and its parameters). A file
    part is an external data table, which this front does not take."""
    parser = email.parser.BytesParser(policy=email.policy.HTTP)
    message = parser.parsebytes(b"Content-Type: " + content_type.encode("latin-1")
                                + b"\r\n\r\n" + body)
    fields: dict[str, str] = {}
    for part in message.iter_parts():  # type: ignore[attr-defined]  # a multipart message
        name = part.get_param("name", header="content-disposition")
        if part.get_filename() is not None:
            raise Refused(NOT_IMPLEMENTED, "external data tables are not supported by this "
                          "test front", 501)
        payload = part.get_payload(decode=True)
        if name and isinstance(payload, bytes):
            fields[str(name)] = payload.decode("utf-8", "surrogateescape")
    return fields


def statement(params: Mapping[str, str], body: bytes, *, content_type: str = "",
              get: bool = False) -> Statement:
    """The statement a request carries (`params`: its URL parameters, `body` decoded).

    The text is the `query` parameter, then a newline and the body; parameters and
    settings come from the URL (and from a form's fields); a GET is read-only."""
    params = dict(params)
    if content_type.lower().startswith("multipart/form-data"):
        params.update(form_fields(content_type, body))
        body = b""
    if params.get("decompress") in ("1", "true"):
        raise Refused(NOT_IMPLEMENTED, "ClickHouse's compressed body format (decompress=1) "
                      "is not supported by this test front", 501)
    query = params.get("query", "").encode("utf-8", "surrogateescape")
    text = query + b"\n" + body if query and body else query or body
    settings: list[tuple[str, str]] = []
    bound: dict[str, str] = {}
    for name, value in params.items():
        if name.startswith(PARAM_PREFIX):
            bound[name[len(PARAM_PREFIX):]] = value
        elif name not in TRANSPORT:
            if not _SETTING_NAME.match(name):
                raise Refused(UNKNOWN_SETTING, f"Unknown setting {name!r}", 400)
            settings.append((name, value))
    if get and not any(name == "readonly" for name, _ in settings):
        settings.append(("readonly", "2"))  # as a server does: a GET changes nothing
    return Statement(text=text, database=params.get("database", ""),
                     settings=handle_settings(settings), params=bound,
                     default_format=params.get("default_format") or DEFAULT_FORMAT,
                     query_id=params.get("query_id") or str(uuid.uuid4()))


def handle_settings(settings: list[tuple[str, str]]) -> Settings:
    """Settings in the order a handle applies them: by name, `readonly` last (after it no
    setting may change)."""
    ordered = sorted(dict(settings).items())
    return tuple([s for s in ordered if s[0] != "readonly"]
                 + [s for s in ordered if s[0] == "readonly"])


def insert_data(text: bytes) -> InsertData | None:
    """The head, format and data of an `INSERT ... FORMAT <fmt>` followed by its rows; None
    for any other statement (an INSERT with VALUES or SELECT runs as it is)."""
    m = _INSERT_HEAD.match(text)
    if m is None or _ROWS_IN_HEAD.search(m.group(1)):
        return None
    head, settings = m.group(1), b""
    s = _SETTINGS_IN_HEAD.search(head)
    if s is not None:
        head, settings = head[:s.start()], s.group(1)
    return InsertData(head, settings, m.group(2).decode("ascii"), text[m.end():])


def output_format(text: bytes, default: str) -> str | None:
    """The format a statement's result comes in, or None when it returns no result set."""
    m = _TRAILING_FORMAT.search(text)
    if m is not None and _FORMAT_NAME.match(m.group(1)):
        return m.group(1).decode("ascii")
    return default if _READS.match(text) else None


def quote(value: str) -> str:
    """A ClickHouse string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def quote_name(name: str) -> str:
    """A ClickHouse identifier, back-quoted."""
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def refusal(exc: Exception) -> Refused:
    """An engine exception as ClickHouse reports it: its code and its text."""
    message = str(exc).strip() or type(exc).__name__
    m = _CODE.search(message)
    return Refused(int(m.group(1)) if m else UNKNOWN_EXCEPTION, message)


# -- the engine -------------------------------------------------------------------------------


class Engine:
    """The chDB engine of one data directory, opened by this process, and its handles.

    chDB hosts one engine per process and any number of handles (sessions) on it; a
    handle's USE and SET stay its own. So each distinct (database, settings) of the
    requests gets a handle set up once, kept (up to MAX_HANDLES, least recently used
    dropped), and every call holds one lock.
    """

    def __init__(self, path: Path, scratch: Path) -> None:
        import chdb

        path.mkdir(parents=True, exist_ok=True)
        self.path = os.path.realpath(path)
        self.scratch = scratch
        self._connect = chdb.connect
        self._lock = threading.Lock()
        self._base = self._connect(self.path)  # opens the engine (loads its tables) now
        self._handles: OrderedDict[tuple[str, Settings], Any] = OrderedDict()

    def _handle(self, database: str, settings: Settings) -> Any:
        """The handle for a database and settings, set up on first use (lock held)."""
        key = (database, settings)
        if not database and not settings:
            return self._base
        conn = self._handles.get(key)
        if conn is not None:
            self._handles.move_to_end(key)
            return conn
        conn = self._connect(self.path)
        try:
            if database:
                conn.query(f"USE {quote_name(database)}", "TabSeparated")
            for name, value in settings:  # names checked by `statement`; readonly last
                conn.query(f"SET {name} = {quote(value)}", "TabSeparated")
        except Exception as exc:
            conn.close()
            raise refusal(exc) from None
        self._handles[key] = conn
        while len(self._handles) > MAX_HANDLES:
            self._handles.popitem(last=False)[1].close()
        return conn

    def run(self, st: Statement) -> Outcome:
        """Run one statement; Refused with ClickHouse's code and text when it fails."""
        insert = insert_data(st.text)
        with self._lock:
            conn = self._handle(st.database, st.settings)
            if insert is not None:
                return self._insert(conn, insert)
            if _SESSION_STATE.match(st.text):  # without a session it changes nothing after
                return self._once(st)
            fmt = output_format(st.text, st.default_format)
            try:
                # The trailing FORMAT is also the engine's default: chDB binds the FORMAT of
                # `EXPLAIN ... FORMAT x` to the explained query, a server to the output.
                result = conn.query(st.text.decode("utf-8", "surrogateescape"),
                                    fmt or st.default_format, params=st.params)
            except Exception as exc:
                raise refusal(exc) from None
        return Outcome(result.bytes() or b"", fmt, summary(result, written=False))

    def _once(self, st: Statement) -> Outcome:
        """A SET or USE, checked by the engine on a handle of its own, then dropped, so the
        kept handles never change (lock held)."""
        conn = self._connect(self.path)
        try:
            if st.database:
                conn.query(f"USE {quote_name(st.database)}", "TabSeparated")
            for name, value in st.settings:
                conn.query(f"SET {name} = {quote(value)}", "TabSeparated")
            conn.query(st.text.decode("utf-8", "surrogateescape"), st.default_format)
        except Exception as exc:
            raise refusal(exc) from None
        finally:
            conn.close()
        return Outcome(b"", None, {})

    def _insert(self, conn: Any, insert: InsertData) -> Outcome:
        """An INSERT's rows, from a scratch file (lock held)."""
        if not insert.data.strip():
            return Outcome(b"", None, {"written_rows": "0", "written_bytes": "0"})
        fd, name = tempfile.mkstemp(dir=self.scratch, suffix=".data")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(insert.data)
            head = insert.head.decode("utf-8", "surrogateescape")
            tail = insert.settings.decode("utf-8", "surrogateescape")
            sql = (f"{head} FROM INFILE {quote(name)}" + (f" SETTINGS {tail}" if tail else "")
                   + f" FORMAT {insert.fmt}")
            try:
                result = conn.query(sql, "TabSeparated")
            except Exception as exc:
                raise refusal(exc) from None
        finally:
            os.unlink(name)
        return Outcome(b"", None, summary(result, written=True))

    def close(self) -> None:
        """Close every handle (the engine flushes and releases its directory)."""
        with self._lock:
            for conn in self._handles.values():
                conn.close()
            self._handles.clear()
            self._base.close()


def summary(result: Any, *, written: bool) -> dict[str, str]:
    """`X-ClickHouse-Summary`'s figures from a chDB result (an INFILE insert reads the rows
    it writes)."""
    try:
        rows, size = str(result.rows_read()), str(result.bytes_read())
        out = {"read_rows": rows, "read_bytes": size,
               "elapsed_ns": str(int(result.elapsed() * 1e9))}
        if written:
            out.update(written_rows=rows, written_bytes=size)
        return out
    except Exception:
        return {}


# -- HTTP -------------------------------------------------------------------------------------


class Front(ThreadingHTTPServer):
    """The HTTP server: one thread per connection, one engine behind a lock."""

    daemon_threads = True
    allow_reuse_address = True  # back on the same port at once after a kill

    def __init__(self, address: tuple[str, int], engine: Engine, verbose: bool) -> None:
        super().__init__(address, Handler)
        self.engine = engine
        self.verbose = verbose


class Handler(BaseHTTPRequestHandler):
    """One connection (keep-alive: clickhouse-connect pools its connections)."""

    protocol_version = "HTTP/1.1"
    server: Front

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._serve(get=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(get=True)

    def do_POST(self) -> None:  # noqa: N802
        self._serve(get=False)

    def _serve(self, *, get: bool) -> None:
        t0 = time.perf_counter()
        url = urlsplit(self.path)
        params = dict(parse_qsl(url.query, keep_blank_values=True))
        try:
            body = decode_body(self._read_body(), self.headers.get("Content-Encoding", ""))
            if url.path == "/ping" or (url.path == "/" and not params.get("query")
                                       and not body):
                self._reply(200, b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"})
                return
            if url.path != "/":
                raise Refused(NOT_IMPLEMENTED, f"no handler for {url.path}", 404)
            st = statement(params, body, content_type=self.headers.get("Content-Type", ""),
                           get=get)
            out = self.server.engine.run(st)
        except Refused as exc:
            self._reply(exc.status, (str(exc) + "\n").encode("utf-8", "replace"),
                        {"Content-Type": "text/plain; charset=UTF-8",
                         "X-ClickHouse-Exception-Code": str(exc.code)})
            self._note(exc.status, params, t0, str(exc))
            return
        headers = {"Content-Type": _CONTENT_TYPES.get(out.fmt or "",
                                                      "text/plain; charset=UTF-8"),
                   "X-ClickHouse-Query-Id": st.query_id,
                   "X-ClickHouse-Summary": json.dumps(out.summary)}
        if out.fmt is not None:
            headers["X-ClickHouse-Format"] = out.fmt
        self._reply(200, out.body, headers)
        self._note(200, params, t0, st.text[:80].decode("utf-8", "replace"))

    def _read_body(self) -> bytes:
        """The request body, by Content-Length or chunked."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                line = self.rfile.readline(65537)
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise Refused(UNKNOWN_EXCEPTION, "malformed chunked body", 400) from None
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _reply(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _note(self, status: int, params: Mapping[str, str], t0: float, what: str) -> None:
        if self.server.verbose:
            ms = (time.perf_counter() - t0) * 1e3
            line = " ".join(what.split())
            print(f"chdb_http: {self.command} {status} {ms:.1f} ms {line[:120]}",
                  file=sys.stderr, flush=True)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Quiet: `_note` logs requests when asked to."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="the chDB data directory")
    ap.add_argument("--port", type=int, default=8123, help="0: any free port (printed)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--scratch", type=Path, default=None,
                    help="where an INSERT's data waits for the engine (default: a temporary "
                    "directory, removed at exit; a killed front leaves it behind)")
    ap.add_argument("--verbose", action="store_true", help="one line per request on stderr")
    args = ap.parse_args(argv)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="chdb-http-"))
    scratch.mkdir(parents=True, exist_ok=True)
    engine = Engine(args.path, scratch)  # before listening: no answer until tables load
    try:
        server = Front((args.host, args.port), engine, args.verbose)

        def stop(_signum: int, _frame: Any) -> None:
            threading.Thread(target=server.shutdown, daemon=True).start()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        print(f"chdb_http: ClickHouse HTTP on http://{args.host}:{server.server_port}, chDB "
              f"data in {engine.path}", flush=True)
        server.serve_forever(poll_interval=0.2)
        server.server_close()
    finally:
        engine.close()
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
