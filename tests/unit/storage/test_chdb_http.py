"""load-tests/chdb_http.py, the test stand-in for a ClickHouse server, without its engine:
how it reads a request (statement, parameters, settings, form fields, encoded bodies, an
INSERT's data) and how it answers over HTTP, success and error, as ClickHouse does. The
engine behind it is exercised by load-tests/reliability_storage_outage.py (Flare's
migrations, writer and reads through it, against embedded chDB)."""

from __future__ import annotations

import gzip
import http.client
import importlib.util
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import lz4.frame  # type: ignore[import-untyped]  # clickhouse-connect's own codec
import pytest
from urllib3 import encode_multipart_formdata

FRONT_PY = Path(__file__).resolve().parents[3] / "load-tests" / "chdb_http.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chdb_http", FRONT_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chdb_http"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


front = _load()


def test_the_statement_is_the_query_parameter_then_the_body() -> None:
    st = front.statement({"query": "INSERT INTO t FORMAT TSV"}, b"1\n")
    assert st.text == b"INSERT INTO t FORMAT TSV\n1\n"
    assert front.statement({}, b"SELECT 1").text == b"SELECT 1"
    assert front.statement({"query": "SELECT 1"}, b"").text == b"SELECT 1"


def test_parameters_settings_and_the_transports_own_are_told_apart() -> None:
    st = front.statement({"database": "flare", "param_job": "a\\tb", "readonly": "1",
                          "max_threads": "2", "session_id": "s", "query_id": "q",
                          "wait_end_of_query": "1", "enable_http_compression": "1",
                          "date_time_input_format": "best_effort"}, b"SELECT 1")
    assert st.database == "flare" and st.query_id == "q"
    assert st.params == {"job": "a\\tb"}  # passed on escaped, as the engine takes them
    assert st.settings == (("date_time_input_format", "best_effort"), ("max_threads", "2"),
                           ("readonly", "1"))  # readonly last: nothing can change after it
    assert front.statement({}, b"SELECT 1", get=True).settings == (("readonly", "2"),)
    with pytest.raises(front.Refused) as err:
        front.statement({"max threads": "1"}, b"SELECT 1")
    assert err.value.code == front.UNKNOWN_SETTING


def test_a_form_carries_the_query_and_its_parameters() -> None:
    body, content_type = encode_multipart_formdata(
        {"query": "SELECT {q:String}", "param_q": "x" * 10_000})  # as clickhouse-connect does
    st = front.statement({"database": "flare"}, body, content_type=content_type)
    assert st.text == b"SELECT {q:String}" and st.params == {"q": "x" * 10_000}
    files, file_type = encode_multipart_formdata({"t": ("t.tsv", b"1\n")})
    with pytest.raises(front.Refused) as err:
        front.statement({}, files, content_type=file_type)
    assert err.value.status == 501


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "lz4", "identity", ""])
def test_encoded_bodies_are_decoded(encoding: str) -> None:
    data = b"INSERT INTO t FORMAT TSV\n" + b"1\n" * 1000
    coded = {"gzip": gzip.compress, "deflate": zlib.compress,
             "lz4": lz4.frame.compress}.get(encoding, lambda b: b)(data)
    assert front.decode_body(coded, encoding) == data


def test_an_unknown_or_broken_encoding_is_refused() -> None:
    with pytest.raises(front.Refused) as err:
        front.decode_body(b"x", "br")
    assert err.value.status == 501
    with pytest.raises(front.Refused) as err:
        front.decode_body(b"not gzip", "gzip")
    assert err.value.code == front.CANNOT_DECOMPRESS


def test_an_inserts_data_is_split_from_its_head() -> None:
    arrow = b"ARROW1\x00\x00FORMAT Native\n\xff"  # binary, even with the word in it
    got = front.insert_data(b"INSERT INTO flare.ops (`job`, `step`) FORMAT Arrow\n" + arrow)
    assert got == front.InsertData(b"INSERT INTO flare.ops (`job`, `step`)", b"", "Arrow",
                                   arrow)
    got = front.insert_data(b"INSERT INTO t (a) SETTINGS async_insert=0 FORMAT Native\nxy")
    assert got is not None and (got.head, got.settings, got.data) == (
        b"INSERT INTO t (a)", b"async_insert=0", b"xy")
    assert front.insert_data(b"INSERT INTO t SELECT {v:UInt32}, now64(3)") is None
    assert front.insert_data(b"INSERT INTO t VALUES (1)") is None
    assert front.insert_data(b"SELECT 1 FORMAT Native") is None


def test_the_output_format_is_the_statements_own() -> None:
    assert front.output_format(b"SELECT 1\n FORMAT Native", "TabSeparated") == "Native"
    assert front.output_format(b"EXPLAIN AST SELECT 1\n FORMAT Native", "TSV") == "Native"
    assert front.output_format(b"SELECT 1", "TabSeparated") == "TabSeparated"
    assert front.output_format(b"CREATE DATABASE x", "TabSeparated") is None


def test_an_engine_error_keeps_clickhouses_code() -> None:
    err = front.refusal(RuntimeError("Code: 60. DB::Exception: Unknown table (UNKNOWN_TABLE)"))
    assert (err.code, err.status) == (60, 500)
    assert front.refusal(RuntimeError("boom")).code == front.UNKNOWN_EXCEPTION


class FakeEngine:
    """Answers one statement, refuses another, and keeps what it was asked."""

    def __init__(self) -> None:
        self.asked: list[Any] = []

    def run(self, st: Any) -> Any:
        self.asked.append(st)
        if st.text.startswith(b"SELECT nope"):
            raise front.Refused(60, "Code: 60. DB::Exception: Unknown table. (UNKNOWN_TABLE)")
        return front.Outcome(b"1\n", front.output_format(st.text, st.default_format),
                             {"read_rows": "1"})


@pytest.fixture
def served() -> Iterator[tuple[FakeEngine, int]]:
    engine = FakeEngine()
    server = front.Front(("127.0.0.1", 0), engine, False)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield engine, server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _ask(port: int, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request(method, path, body=body, headers=headers or {})
    return conn.getresponse()


def test_it_answers_as_a_clickhouse_server(served: tuple[FakeEngine, int]) -> None:
    engine, port = served
    for path in ("/ping", "/"):
        r = _ask(port, "GET", path)
        assert (r.status, r.read()) == (200, b"Ok.\n")
    r = _ask(port, "POST", "/?database=flare&param_j=x&query_id=42", b"SELECT {j:String}")
    assert (r.status, r.read()) == (200, b"1\n")
    assert r.getheader("X-ClickHouse-Format") == "TabSeparated"
    assert r.getheader("X-ClickHouse-Query-Id") == "42"
    assert r.getheader("X-ClickHouse-Exception-Code") is None
    assert engine.asked[-1].params == {"j": "x"} and engine.asked[-1].database == "flare"
    r = _ask(port, "POST", "/", b"SELECT nope")
    assert r.status == 500 and r.getheader("X-ClickHouse-Exception-Code") == "60"
    assert r.read().startswith(b"Code: 60. DB::Exception: Unknown table")


def test_a_chunked_body_is_read_whole(served: tuple[FakeEngine, int]) -> None:
    engine, port = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("POST", "/?query=SELECT", body=iter([b" 1", b" + 2"]),
                 headers={"Transfer-Encoding": "chunked"}, encode_chunked=True)
    assert conn.getresponse().status == 200
    assert engine.asked[-1].text == b"SELECT\n 1 + 2"
