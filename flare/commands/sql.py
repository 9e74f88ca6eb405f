"""`flare sql "SELECT …"`: one read-only statement against Flare's ClickHouse, as a table.

The embedded store belongs to the worker (one process owns a chDB directory), so by default
the statement goes through the running API (`POST /v1/sql`); with a ClickHouse server it can
go there directly (`--clickhouse`, or FLARE_CLICKHOUSE_URL when that names a server), and
`--clickhouse chdb:///./data/chdb` reads the directory of a `flare up` that is stopped. Both
ways run it the same, through `storage.adhoc`: read-only, one statement, bounded.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import sys
from collections.abc import Iterator
from typing import Any

import typer

FORMATS = ("table", "csv", "json")


def cell(value: Any) -> str:
    """A value as a table or CSV shows it: NULL for null, JSON for arrays and maps.

    >>> cell(None), cell([1, "a"]), cell({"k": 1.5}), cell(True), cell("x")
    ('NULL', '[1,"a"]', '{"k":1.5}', 'true', 'x')
    """
    import orjson

    if value is None:
        return "NULL"
    if isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def records(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of an answer (`POST /v1/sql`'s body) as objects keyed by column name.

    >>> records({"columns": [{"name": "a"}, {"name": "b"}], "rows": [[1, None]]})
    [{'a': 1, 'b': None}]
    """
    names = [c["name"] for c in result["columns"]]
    return [dict(zip(names, row, strict=True)) for row in result["rows"]]


def to_csv(result: dict[str, Any]) -> str:
    """A header line, then one line per row (null is empty, arrays and maps are JSON).

    >>> print(to_csv({"columns": [{"name": "a"}, {"name": "b"}], "rows": [[1, "x,y"],
    ...                                                                   [None, [2]]]}), end="")
    a,b
    1,"x,y"
    ,[2]
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([c["name"] for c in result["columns"]])
    for row in result["rows"]:
        writer.writerow(["" if v is None else cell(v) for v in row])
    return out.getvalue()


def print_table(result: dict[str, Any]) -> None:
    """A table on stdout; cells are text, never rich markup. Piped, the table is as wide as
    its cells (rich would fold it into 80 columns)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(show_edge=False)
    for c in result["columns"]:
        table.add_column(c["name"])
    for row in result["rows"]:
        table.add_row(*(Text(cell(v), style="dim" if v is None else "") for v in row))
    wide = None if sys.stdout.isatty() else 1_000_000
    Console(file=sys.stdout, highlight=False, emoji=False, width=wide).print(table)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"flare sql: {message}", err=True)
    return typer.Exit(2)


def _via_api(query: str, api: str | None) -> dict[str, Any]:
    """The answer of the running API's POST /v1/sql."""
    import httpx

    from flare.api_client import api_client, api_url, error_detail
    from flare.settings import Settings

    settings = Settings()
    url = api_url(settings, api)
    try:
        with api_client(settings, url, timeout_s=120.0) as client:
            r = client.post("/v1/sql", json={"query": query})
    except httpx.HTTPError as exc:
        raise _fail(f"no API at {url} ({type(exc).__name__}); start `flare up` or `flare "
                    "worker`, pass --api, or --clickhouse for a ClickHouse server") from None
    if r.status_code != 200:
        raise _fail(f"{url} answered {r.status_code}: {error_detail(r)}")
    answer: dict[str, Any] = r.json()
    return answer


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Silence file descriptor 2 for a moment: chDB's engine prints its own error there
    (a locked data directory, say) before it raises, and the CLI says it in one line."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _direct(query: str, url: str, password: Any) -> dict[str, Any]:
    """The answer of a read-only session opened here (storage.adhoc)."""
    import logging

    from storage.adhoc import SQLRefused, open_readonly
    from storage.client import StorageError

    # the driver logs a traceback of its own before it raises; the one line below says it
    logging.getLogger("clickhouse_connect").setLevel(logging.CRITICAL)
    quiet = _native_stderr_silenced() if url.startswith("chdb:") else contextlib.nullcontext()
    try:
        with quiet:
            session = open_readonly(url, password)
        with session as sql:
            answer = sql.run(query)
    except SQLRefused as exc:
        raise _fail(str(exc)) from None
    except (StorageError, ValueError) as exc:
        hint = ("; while `flare up` or a worker owns the directory, leave out --clickhouse "
                "to go through its API") if url.startswith("chdb:") else ""
        raise _fail(" ".join(str(exc).split()) + hint) from None
    return {"columns": [{"name": n, "type": t} for n, t in answer.columns],
            "rows": answer.rows, "truncated": answer.truncated, "max_rows": answer.max_rows}


def register(app: typer.Typer) -> None:
    @app.command("sql")
    def sql_cmd(
        query: str = typer.Argument(
            ..., help="one statement (SELECT, WITH, SHOW, DESCRIBE, EXISTS, EXPLAIN) over "
            "Flare's tables, e.g. \"SELECT kind, count() FROM incidents GROUP BY kind\"; "
            "- reads it from stdin"),
        as_json: bool = typer.Option(False, "--json",
                                     help="print the rows as a JSON list of objects"),
        fmt: str = typer.Option("table", "--format", help="table, csv or json"),
        api: str | None = typer.Option(
            None, envvar="FLARE_API_URL", show_envvar=True,
            help="the API's URL (default http://<FLARE_API_HOST>:<FLARE_API_PORT>)"),
        clickhouse: str | None = typer.Option(
            None, "--clickhouse",
            help="run it directly on this ClickHouse (http(s)://user@host:port/db, or the "
            "chdb:/// directory of a stopped `flare up`) instead of through the API; "
            "default: FLARE_CLICKHOUSE_URL when it names a server and no --api is given"),
    ) -> None:
        """Run one read-only SQL statement on Flare's store and print the rows."""
        import orjson

        from flare.settings import Settings

        if fmt not in FORMATS:
            raise typer.BadParameter(f"must be one of {', '.join(FORMATS)}",
                                     param_hint="--format")
        if as_json and fmt not in ("table", "json"):
            raise typer.BadParameter("--json prints JSON; leave out --format",
                                     param_hint="--json")
        fmt = "json" if as_json else fmt
        text = sys.stdin.read() if query == "-" else query
        if not text.strip():
            raise _fail("an empty statement")
        settings = Settings()
        if clickhouse is None and api is None and settings.clickhouse_url.startswith("http"):
            clickhouse = settings.clickhouse_url
        result = (_direct(text, clickhouse, settings.clickhouse_password) if clickhouse
                  else _via_api(text, api))
        if fmt == "json":
            typer.echo(orjson.dumps(records(result), option=orjson.OPT_INDENT_2).decode())
        elif fmt == "csv":
            typer.echo(to_csv(result), nl=False)
        else:
            print_table(result)
        rows = len(result["rows"])
        if result["truncated"]:
            typer.echo(f"the first {rows} rows: the result has more (the limit is "
                       f"{result['max_rows']} rows and a byte budget); add LIMIT or "
                       "aggregate", err=True)
        elif fmt == "table":
            typer.echo(f"{rows} row{'s' if rows != 1 else ''}", err=True)
