"""No value reaches SQL text: every statement Flare sends is built from code alone (constants,
table and column names from the table specs, validated integers); values go as bound
parameters (`{name:Type}`, `parameters=`). Checked on the source itself, so new code is held
to it too.

The check reads every module of the packages that talk to ClickHouse (and load-tests/) with
`ast` and looks at two things:
- every call that sends SQL (`.rows/.columns/.command/.query(...)` and the like): its SQL
  argument, followed back through the function's own assignments, appends and loops;
- every f-string, `+`, `%` or `.format` whose text starts like a statement (SELECT, INSERT,
  CREATE, SET, ...), wherever it is built.
Each formatted part must be *vetted*: a string constant; a module constant (UPPER_CASE: code,
built from the table specs); a vetted helper below, with vetted arguments where it builds
text; the `database` attribute (storage.client checks it is a plain identifier); a
comprehension or loop over vetted things. Anything else (a parameter, an attribute of a
request, a local fed by one) is a finding.

A few functions are exempt, each with its reason (SQL_EXEMPT): the client seam that passes
SQL through, `storage.adhoc`, whose job is to run what an on-call types, read-only, and
`load-tests/chdb_http.py`, the test stand-in for a ClickHouse server, which runs what its
HTTP client sends.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ("storage", "api", "streams", "flare", "load-tests")
SENDS_SQL = {"rows", "columns", "command", "query", "_query", "query_arrow", "query_df",
             "query_np", "raw_query", "query_row_block_stream"}
STATEMENT = re.compile(r"^\s*(SELECT|INSERT|CREATE|ALTER|DROP|TRUNCATE|SET|EXPLAIN|WITH|SHOW|"
                       r"DESCRIBE|OPTIMIZE|DELETE FROM|RENAME|GRANT|KILL|SYSTEM)\b")
CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
# Helpers whose result is safe text. Validators take any argument (they refuse what is not
# safe); builders only make safe text of safe parts.
VALIDATORS = {
    "_int": "storage.reader: a non-negative int, or ValueError",
}
BUILDERS = {
    "table": "ClickHouse.table: `database.name`",
    "select_list": "storage.reader: the SELECT list of columns from storage.tables",
    "statements": "Migration.statements: the DDL of the shipped infra/*.sql files",
    "_ledger_ddl": "storage.migrations: the ledger's DDL for a database name",
    "join": "str.join",
    "items": "dict.items", "values": "dict.values", "keys": "dict.keys",
}
VETTED_ATTRIBUTES = {"database": "storage.client._database refuses any non-identifier"}
SQL_EXEMPT = {
    ("storage/client.py", "ClickHouse.command"): "the seam: passes its caller's SQL through",
    ("storage/client.py", "ClickHouse.rows"): "the seam: passes its caller's SQL through",
    ("storage/client.py", "ClickHouse.columns"): "the seam: passes its caller's SQL through",
    ("storage/adhoc.py", "ReadOnlySQL._query"): "the seam of the read-only session",
    ("storage/adhoc.py", "ReadOnlySQL.run"): "runs what an on-call typed, by design: "
    "read-only session, parsed by ClickHouse first, one read only (storage/adhoc.py)",
    ("storage/adhoc.py", "open_readonly"): "SET of the session's limits: names and "
    "integers from Limits, code",
    ("storage/migrations.py", "_ledger_ddl"): "DDL for a database name its callers take "
    "from ClickHouse.database (a checked identifier)",
    ("load-tests/chdb_http.py", "Engine.run"): "the test stand-in for a ClickHouse server: "
    "runs the statement its HTTP client sent, as the server does",
    ("load-tests/chdb_http.py", "Engine._handle"): "the test stand-in for a server: USE and "
    "SET of a request's database and settings (names checked identifiers, values quoted)",
    ("load-tests/chdb_http.py", "Engine._insert"): "the test stand-in for a server: the "
    "client's INSERT head, FROM INFILE of the front's own scratch file",
    ("load-tests/chdb_http.py", "Engine._once"): "the test stand-in for a server: a client's "
    "SET or USE, on a handle of its own that is then dropped",
}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    code: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.code}"


class Checker:
    """The check of one module (see the module docstring)."""

    def __init__(self, source: str, path: str) -> None:
        self.source, self.path = source, path
        self.tree = ast.parse(source)
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.findings: list[Finding] = []

    # -- where a node is ---------------------------------------------------------------------

    def function(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                return node
        return None

    def qualname(self, fn: ast.AST) -> str:
        names, node = [], fn
        while True:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.append(node.name)
            if node not in self.parents:
                return ".".join(reversed(names))
            node = self.parents[node]

    def exempt(self, node: ast.AST) -> bool:
        fn = self.function(node)
        while fn is not None:
            if (self.path, self.qualname(fn)) in SQL_EXEMPT:
                return True
            fn = self.function(fn)
        return False

    # -- is an expression safe SQL text ------------------------------------------------------

    def vetted(self, e: ast.AST, fn: ast.AST | None, seen: frozenset[str] = frozenset(),
               bound: frozenset[str] = frozenset()) -> bool:
        v = lambda x: self.vetted(x, fn, seen, bound)  # noqa: E731
        if isinstance(e, ast.Constant):
            return isinstance(e.value, str | int | float | bool | type(None))
        if isinstance(e, ast.JoinedStr):
            return all(v(p.value) if isinstance(p, ast.FormattedValue) else True
                       for p in e.values)
        if isinstance(e, ast.FormattedValue):
            return v(e.value)
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add | ast.Mod):
            return v(e.left) and v(e.right)
        if isinstance(e, ast.IfExp):
            return v(e.body) and v(e.orelse)
        if isinstance(e, ast.BoolOp):
            return all(v(x) for x in e.values)
        if isinstance(e, ast.List | ast.Tuple | ast.Set):
            return all(v(x.value if isinstance(x, ast.Starred) else x) for x in e.elts)
        if isinstance(e, ast.Subscript):  # a code constant looked up: the key picks, not adds
            return v(e.value)
        if isinstance(e, ast.Attribute):  # an attribute of code is code
            return e.attr in VETTED_ATTRIBUTES or v(e.value)
        if isinstance(e, ast.Call):
            name = (e.func.attr if isinstance(e.func, ast.Attribute)
                    else e.func.id if isinstance(e.func, ast.Name) else "")
            if name in VALIDATORS:
                return True
            if name == "format" and isinstance(e.func, ast.Attribute):
                return v(e.func.value) and all(v(a) for a in e.args)
            if name in BUILDERS:
                receiver = e.func.value if isinstance(e.func, ast.Attribute) else None
                if name in ("join", "items", "values", "keys") and receiver is not None:
                    if not v(receiver):
                        return False
                return all(v(a) for a in e.args) and all(v(k.value) for k in e.keywords)
            return False
        if isinstance(e, ast.ListComp | ast.GeneratorExp | ast.SetComp):
            inner = bound
            for gen in e.generators:
                if not self.vetted(gen.iter, fn, seen, inner):
                    return False
                inner = inner | {n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
            return self.vetted(e.elt, fn, seen, inner)
        if isinstance(e, ast.Name):
            if e.id in bound or CONSTANT.match(e.id):
                return True
            if e.id in seen or fn is None:
                return False
            return self.local_vetted(e.id, fn, seen | {e.id})
        return False

    def local_vetted(self, name: str, fn: ast.AST, seen: frozenset[str]) -> bool:
        """Every value the function gives `name` is vetted; a parameter is, only of a private
        function whose every call in the module passes vetted text for it."""
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
        if name in params or name in {a.arg for a in fn.args.kwonlyargs}:
            return self.callers_pass_vetted(fn, name, seen)
        sources = list(self.bindings(name, fn))
        return bool(sources) and all(self.vetted(s, fn, seen) for s in sources)

    def callers_pass_vetted(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, param: str,
                            seen: frozenset[str]) -> bool:
        if not fn.name.startswith("_") or fn.name.startswith("__"):
            return False  # callable from anywhere: its callers are not all in sight
        positional = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
        method = isinstance(self.parents.get(fn), ast.ClassDef)
        calls = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)
                 and (n.func.attr if isinstance(n.func, ast.Attribute) else
                      n.func.id if isinstance(n.func, ast.Name) else None) == fn.name]
        for call in calls:
            args = positional[1:] if method and isinstance(call.func, ast.Attribute) else positional
            given = {k.arg: k.value for k in call.keywords if k.arg}
            given.update(zip(args, call.args, strict=False))
            if param not in given:
                return False  # a default or **kwargs: not followed
            key = f"{fn.name}:{param}@{id(call)}"
            if key in seen or not self.vetted(given[param], self.function(call), seen | {key}):
                return False
        return bool(calls)

    def bindings(self, name: str, fn: ast.AST) -> Iterator[ast.AST]:
        """What `name` is given in `fn`: assignments, `+=`, `.append/.extend/.insert`, loop
        targets (an element of a literal, position by position, or the loop's iterable)."""
        for node in ast.walk(fn):
            if self.function(node) is not fn and node is not fn:
                continue
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if node.value is not None:
                    for t in targets:
                        yield from self.positions(name, t, node.value)
            elif isinstance(node, ast.For | ast.AsyncFor):
                if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.target)):
                    if isinstance(node.iter, ast.List | ast.Tuple):
                        for elt in node.iter.elts:
                            yield from self.positions(name, node.target, elt)
                    else:
                        yield node.iter
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and isinstance(node.func.value, ast.Name) and node.func.value.id == name
                  and node.func.attr in ("append", "extend", "insert")):
                yield node.args[-1]
            elif isinstance(node, ast.NamedExpr | ast.withitem | ast.ExceptHandler):
                target = getattr(node, "target", None) or getattr(node, "optional_vars", None)
                if any(isinstance(n, ast.Name) and n.id == name
                       for n in ast.walk(target or ast.Pass())):
                    yield ast.Name("<unknown>")  # never vetted

    def positions(self, name: str, target: ast.AST, value: ast.AST) -> Iterator[ast.AST]:
        """The part of `value` that `target` gives `name` (unpacking a literal by position)."""
        if isinstance(target, ast.Name):
            if target.id == name:
                yield value
        elif isinstance(target, ast.Tuple | ast.List):
            if not any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(target)):
                return
            if isinstance(value, ast.IfExp):
                yield from self.positions(name, target, value.body)
                yield from self.positions(name, target, value.orelse)
            elif isinstance(value, ast.Tuple | ast.List) and len(value.elts) == len(target.elts):
                for t, v in zip(target.elts, value.elts, strict=True):
                    yield from self.positions(name, t, v)
            else:
                yield value  # unpacked from something else: the whole must be vetted

    # -- the two checks ----------------------------------------------------------------------

    def report(self, node: ast.AST) -> None:
        code = ast.get_source_segment(self.source, node) or ast.dump(node)
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0),
                                     " ".join(code.split())[:160]))

    def check(self) -> list[Finding]:
        for node in ast.walk(self.tree):
            if self.exempt(node):
                continue
            fn = self.function(node)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in SENDS_SQL and node.args):
                if not self.vetted(node.args[0], fn):
                    self.report(node)
            elif self.builds_statement(node) and not self.vetted(node, fn):
                self.report(node)
        return self.findings

    @staticmethod
    def builds_statement(node: ast.AST) -> bool:
        first: ast.AST | None = None
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mod):
            first = node.left
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "format"):
            first = node.func.value
        return (isinstance(first, ast.Constant) and isinstance(first.value, str)
                and STATEMENT.match(first.value) is not None)


def check_source(source: str, path: str = "example.py") -> list[Finding]:
    return Checker(textwrap.dedent(source), path).check()


def modules() -> Iterator[tuple[str, str]]:
    for package in SCANNED:
        for file in sorted((ROOT / package).rglob("*.py")):
            yield file.relative_to(ROOT).as_posix(), file.read_text()


def test_no_value_reaches_sql_text_anywhere() -> None:
    findings = [f for path, source in modules() for f in Checker(source, path).check()]
    assert findings == [], "SQL built from something other than code:\n" + "\n".join(
        map(str, findings))


def test_the_check_reads_the_modules_that_send_sql() -> None:
    paths = {path for path, _ in modules()}
    assert {"storage/reader.py", "storage/migrations.py", "storage/client.py"} <= paths
    calls = sum(1 for _, source in modules() for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in SENDS_SQL and node.args)
    assert calls >= 15  # the reader's questions, the migrations, the seam


def test_every_exemption_names_a_function_that_exists() -> None:
    for path, qualname in SQL_EXEMPT:
        checker = Checker((ROOT / path).read_text(), path)
        names = {checker.qualname(n) for n in ast.walk(checker.tree)
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        assert qualname in names, f"stale exemption {path}:{qualname}"


@pytest.mark.parametrize("source", [
    # a value formatted into the text
    """
    def incidents(db, job):
        return db.rows(f"SELECT * FROM t WHERE job = '{job}'")
    """,
    # ... by concatenation, by %, by .format
    """
    def incidents(db, job):
        return db.rows("SELECT * FROM t WHERE job = '" + job + "'")
    """,
    """
    def incidents(db, job):
        return db.rows("SELECT * FROM t WHERE job = '%s'" % job)
    """,
    """
    def incidents(db, job):
        return db.rows("SELECT * FROM t WHERE job = '{}'".format(job))
    """,
    # ... through a local, a list of fragments, a loop over values
    """
    def incidents(db, job):
        sql = f"SELECT * FROM t WHERE job = '{job}'"
        return db.rows(sql)
    """,
    """
    def incidents(db, job, kind):
        where = ["1"]
        for name, value in (("job", job), ("kind", kind)):
            where.append(f"{name} = '{value}'")
        return db.rows("SELECT * FROM t WHERE " + " AND ".join(where))
    """,
    """
    def incidents(db, request):
        return db.command(request.query_params["sql"])
    """,
    # a table name from outside
    """
    def count(db, table):
        return db.rows(f"SELECT count() FROM {db.table(table)}")
    """,
    # a private helper one of whose callers passes a value
    """
    class Q:
        def _summaries(self, where):
            return self.db.rows(f"SELECT * FROM t WHERE {where}")
        def jobs(self):
            return self._summaries("1")
        def job(self, name):
            return self._summaries(f"job = '{name}'")
    """,
    # a public one: callers anywhere
    """
    def summaries(db, where):
        return db.rows(f"SELECT * FROM t WHERE {where}")
    """,
    # a statement built far from where it is sent
    """
    def ddl(name):
        return f"DROP TABLE {name}"
    """,
])
def test_the_check_finds_values_in_sql(source: str) -> None:
    assert check_source(source), source


@pytest.mark.parametrize("source", [
    """
    ORDER = {"rank": "rank", "gap": "gap_s DESC"}
    def scores(self, job, sort, limit):
        where = ["job = {job:String}"]
        for name, value in (("kind", 1), ("status", 2)):
            where.append(f"{name} = {{{name}:String}}")
        return self.db.rows(
            f"SELECT {COLUMNS} FROM {self.db.table('t')} WHERE {' AND '.join(where)}"
            f" ORDER BY {ORDER[sort]} LIMIT {_int(limit)}", {"job": job})
    """,
    """
    class Q:
        def _summaries(self, where, tail):
            return self.db.rows(f"SELECT * FROM t WHERE {where} {tail}")
        def jobs(self, limit):
            return self._summaries("1", f"LIMIT {_int(limit)}")
        def job(self, name):
            return self._summaries(where="job = {job:String}", tail="")
    """,
    """
    def migrate(db):
        for stmt in _ledger_ddl(db.database):
            db.command(stmt)
        order = "ASC" if db else "DESC"
        db.rows(f"SELECT 1 ORDER BY x {order}")
    """,
])
def test_the_check_lets_code_built_sql_pass(source: str) -> None:
    assert check_source(source) == []
