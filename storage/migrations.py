"""Flare's DDL as versioned migrations: each numbered infra/NNN_name.sql file is applied once,
in order, and recorded in `<database>.schema_migrations` (version, name, checksum, applied_at).

The .sql files are the single source of the schema, written for the database `flare` so an
operator can also run them as they are with clickhouse-client; another database name (tests,
several deployments on one server) is substituted for the `flare.` qualifier. The same DDL
runs on a ClickHouse server and in chDB. The worker and `flare api` call `apply_schema` at
each start: a database that is up to date costs two idempotent statements and one read.

Rules for whoever adds a file:
- A shipped file never changes. Its checksum is recorded when it is applied, and a file whose
  text differs from what was applied stops the start with `MigrationError`: otherwise a
  database and a checkout would silently disagree about the schema. Line endings do not count
  (files are read as text).
- A column change reaches existing tables through a new numbered file, e.g.
  `ALTER TABLE flare.rank_steps ADD COLUMN IF NOT EXISTS mem_s Float32 DEFAULT 0`, plus the
  column in `storage.tables` (a test compares the two). A changed view is a new file with
  `CREATE OR REPLACE VIEW`.
- Statements stay idempotent (IF NOT EXISTS): two processes starting together (worker and API
  on one server) may both apply a migration before either has recorded it. The ledger is a
  ReplacingMergeTree on version, so recording it twice is harmless.

Data directories and servers set up before the ledger existed (tables present, no
schema_migrations table) start as before: their files 000–100 are all `CREATE … IF NOT
EXISTS`, so applying them again changes nothing, and they are then recorded as applied.
A table dropped by hand is not recreated at the next start, since its migration is recorded.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from storage.client import ClickHouse, StorageError

LEDGER = "schema_migrations"
log = logging.getLogger(__name__)

_QUALIFIER = re.compile(r"\bflare\.(?=[A-Za-z_])")
_DATABASE = re.compile(r"(CREATE DATABASE IF NOT EXISTS )flare\b")
_FILE = re.compile(r"^(\d+)_[A-Za-z0-9_]+\.sql$")


class MigrationError(StorageError):
    """The migrations on disk contradict the ones a database records as applied."""


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered DDL file: `version` is its number, `name` its file name."""

    version: int
    name: str
    text: str

    @property
    def checksum(self) -> str:
        """sha256 of the file's text: what must never change once the file shipped."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def statements(self, database: str = "flare") -> list[str]:
        """The file's statements, for `database` instead of `flare`."""
        out = []
        for stmt in split_statements(self.text):
            if database != "flare":
                stmt = _DATABASE.sub(rf"\g<1>{database}", stmt)
                stmt = _QUALIFIER.sub(f"{database}.", stmt)
            out.append(stmt)
        return out


def _infra_dirs() -> list[Traversable]:
    """Where `infra` lives. An editable install can expose it as a namespace package,
    which `importlib.resources.files` rejects, so fall back to its real directories."""
    try:
        return [resources.files("infra")]
    except (NotADirectoryError, TypeError):
        import infra

        return [Path(p) for p in infra.__path__ if Path(p).is_dir()]


def ddl_files() -> list[tuple[str, str]]:
    """(file name, text) of every DDL file shipped in the `infra` package, by name."""
    files = {p.name: p for d in _infra_dirs() for p in d.iterdir() if p.name.endswith(".sql")}
    if not files:
        raise FileNotFoundError("no *.sql DDL files in the infra package data")
    return [(name, files[name].read_text(encoding="utf-8")) for name in sorted(files)]


def load_migrations(files: Iterable[tuple[str, str]] | None = None) -> list[Migration]:
    """The migrations in version order, from (file name, text) pairs (default: infra's).
    A file name without a leading number, or two files with one number, is refused."""
    out: dict[int, Migration] = {}
    for name, text in ddl_files() if files is None else files:
        match = _FILE.match(name)
        if match is None:
            raise ValueError(f"DDL file {name!r}: expected NNN_name.sql (a number, then a name)")
        version = int(match.group(1))
        if version in out:
            raise ValueError(f"DDL files {out[version].name!r} and {name!r} share version "
                             f"{version}")
        out[version] = Migration(version, name, text)
    return [out[v] for v in sorted(out)]


def split_statements(text: str) -> list[str]:
    """Statements of one file: `--` comment lines dropped, split at a `;` ending a line."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in re.split(r";[ \t]*(?:\n|$)", body) if s.strip()]


def statements(database: str = "flare") -> list[str]:
    """Every DDL statement of every migration for `database`, in order."""
    return [s for m in load_migrations() for s in m.statements(database)]


def _ledger_ddl(database: str) -> list[str]:
    """The runner's own bookkeeping, created before anything is read from it (so it is not a
    migration itself)."""
    return [
        f"CREATE DATABASE IF NOT EXISTS {database}",
        f"CREATE TABLE IF NOT EXISTS {database}.{LEDGER}\n"
        "(\n"
        "    version    UInt32,\n"
        "    name       String,\n"
        "    checksum   String,\n"
        "    applied_at DateTime64(3, 'UTC') DEFAULT now64(3)\n"
        ")\n"
        "ENGINE = ReplacingMergeTree\n"
        "ORDER BY version",
    ]


def applied_migrations(db: ClickHouse) -> dict[int, dict[str, object]]:
    """What the database records as applied: version -> {name, checksum, applied_at}."""
    rows = db.rows(
        f"SELECT version, name, checksum, applied_at FROM {db.table(LEDGER)} FINAL"
        " ORDER BY version"
    )
    return {int(r.pop("version")): r for r in rows}


def _check(applied: dict[int, dict[str, object]], migrations: list[Migration]) -> None:
    on_disk = {m.version: m for m in migrations}
    for version, row in applied.items():
        m = on_disk.get(version)
        if m is None:
            log.warning("the database records migration %s (%s), which this Flare does not "
                        "ship; it was made by a newer version", version, row["name"])
        elif row["checksum"] != m.checksum:
            raise MigrationError(
                f"migration {m.name} was applied as version {version} with checksum "
                f"{str(row['checksum'])[:12]}…, but its text now has checksum "
                f"{m.checksum[:12]}…: a shipped migration must not change; put the change "
                "in a new numbered file"
            )


def apply_schema(db: ClickHouse, migrations: list[Migration] | None = None) -> list[Migration]:
    """Apply the migrations the database has not recorded yet, in version order, recording
    each after its statements ran; returns the ones applied (none when up to date).

    Every recorded checksum is checked before anything runs, so a changed file applies
    nothing. A failing statement raises StorageError and leaves that migration unrecorded:
    the next start tries it again (which is why statements must be idempotent).
    """
    migrations = load_migrations() if migrations is None else migrations
    for stmt in _ledger_ddl(db.database):
        db.command(stmt)
    applied = applied_migrations(db)
    _check(applied, migrations)
    done: list[Migration] = []
    for m in migrations:
        if m.version in applied:
            continue
        for stmt in m.statements(db.database):
            db.command(stmt)
        db.command(
            f"INSERT INTO {db.table(LEDGER)} (version, name, checksum, applied_at)"
            " SELECT {version:UInt32}, {name:String}, {checksum:String}, now64(3)",
            {"version": m.version, "name": m.name, "checksum": m.checksum},
        )
        log.info("applied migration %s to %s", m.name, db.database)
        done.append(m)
    return done
