"""Apply Flare's DDL (infra/*.sql, package data of `infra`) idempotently.

The .sql files are the single source of the schema, written for the database `flare` so an
operator can run them as they are with clickhouse-client; every statement is `IF NOT EXISTS`,
so applying them at each start (worker, API) is safe and cheap. Another database name (tests,
several deployments on one server) is substituted for the `flare.` qualifier.
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from storage.client import ClickHouse

TABLES: tuple[str, ...] = (
    "job_steps",
    "rank_steps",
    "group_steps",
    "ops",
    "detections",
    "incidents",
    "dead_letters",
)
VIEWS: tuple[str, ...] = ("v_job_steps", "v_rank_scores", "v_open_incidents")

_QUALIFIER = re.compile(r"\bflare\.(?=[A-Za-z_])")
_DATABASE = re.compile(r"(CREATE DATABASE IF NOT EXISTS )flare\b")


def _infra_dirs() -> list[Traversable]:
    """Where `infra` lives. An editable install can expose it as a namespace package,
    which `importlib.resources.files` rejects, so fall back to its real directories."""
    try:
        return [resources.files("infra")]
    except (NotADirectoryError, TypeError):
        import infra

        return [Path(p) for p in infra.__path__ if Path(p).is_dir()]


def ddl_files() -> list[tuple[str, str]]:
    """(file name, text) of every DDL file, in the order they apply."""
    files = {p.name: p for d in _infra_dirs() for p in d.iterdir() if p.name.endswith(".sql")}
    if not files:
        raise FileNotFoundError("no *.sql DDL files in the infra package data")
    return [(name, files[name].read_text(encoding="utf-8")) for name in sorted(files)]


def split_statements(text: str) -> list[str]:
    """Statements of one file: `--` comment lines dropped, split at a `;` ending a line."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in re.split(r";[ \t]*(?:\n|$)", body) if s.strip()]


def statements(database: str = "flare") -> list[str]:
    """Every DDL statement for `database`, in order."""
    out: list[str] = []
    for _name, text in ddl_files():
        for stmt in split_statements(text):
            if database != "flare":
                stmt = _DATABASE.sub(rf"\g<1>{database}", stmt)
                stmt = _QUALIFIER.sub(f"{database}.", stmt)
            out.append(stmt)
    return out


def apply_schema(db: ClickHouse) -> int:
    """Create the database, tables and views that do not exist yet; returns statements run.

    Existing objects are left as they are (no migrations in v1: a changed column needs a new
    table or an explicit ALTER by the operator).
    """
    stmts = statements(db.database)
    for stmt in stmts:
        db.command(stmt)
    return len(stmts)
