"""The read side of Flare's ClickHouse tables, as used by the API (and anyone scripting).

`Reader` is what the API asks of storage; `Queries` answers it from ClickHouse, and
`storage.testing.MemoryStore` answers it from memory for fast API tests. Every read of a
ReplacingMergeTree table uses FINAL, so an answer counts each step, rank and incident once
even while re-delivered duplicates wait for a background merge. Results are plain dicts and
lists; the API's models shape them. Whole-row reads take their column lists from
`storage.tables`, with two rules: DateTime64 columns come back as integer nanoseconds named
`<name>_ns`, and Float32 columns come back rounded to 6 decimals (µs for seconds) rather than
as float32 noise. Parameters are bound by ClickHouse (`{name:Type}`), never spliced into SQL;
only validated integers (limits) and names from the table specs are formatted in.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Literal, Protocol

import msgspec

from storage.client import ClickHouse
from storage.tables import DEAD_LETTERS, INCIDENTS, JOB_STEPS, OPS, RANK_STEPS, Column, Table

Row = dict[str, Any]
RankSort = Literal["rank", "caused_wait", "compute_ratio", "gap"]
_RANK_ORDER: dict[str, str] = {
    "rank": "rank",
    "caused_wait": "caused_wait_s DESC, rank",
    "compute_ratio": "compute_ratio, rank",
    "gap": "gap_s DESC, rank",
}


def read_columns(table: Table, exclude: tuple[str, ...] = ()) -> tuple[Column, ...]:
    """The columns a whole-row read returns: the written ones (not server bookkeeping such
    as `inserted_at`) minus `exclude`."""
    return tuple(c for c in table.written if c.name not in exclude)


def _select(c: Column) -> str:
    if c.read_name != c.name:
        return f"toUnixTimestamp64Nano({c.name}) AS {c.read_name}"
    if c.type == "Float32":
        return f"round(toFloat64({c.name}), 6) AS {c.name}"
    return c.name


def select_list(columns: tuple[Column, ...]) -> str:
    """The SELECT list of a whole-row read, with the two rules of the module docstring."""
    return ", ".join(_select(c) for c in columns)


# Whole rows: an incident (minus its ReplacingMergeTree version), a job step (its job is
# the question), a dead letter.
INCIDENT_COLUMNS = read_columns(INCIDENTS, exclude=("version",))
STEP_COLUMNS = read_columns(JOB_STEPS, exclude=("job",))
DEAD_LETTER_COLUMNS = read_columns(DEAD_LETTERS)
OP_COLUMNS = read_columns(OPS, exclude=("job",))  # raw ops: the job is the question
STEP_FIELDS: tuple[tuple[str, Any], ...] = tuple((c.read_name, c.read_type) for c in STEP_COLUMNS)
# Per-rank scores average every per-rank figure of rank_steps (its Float32 columns), and add
# the total wait a rank caused and its lowest compute ratio.
RANK_FIGURES = tuple(c for c in RANK_STEPS.written if c.type == "Float32")
RANK_SCORE_FIELDS: tuple[tuple[str, Any], ...] = (
    ("rank", int), ("node", str), ("steps", int),
    *((c.name, float) for c in RANK_FIGURES),
    ("caused_wait_total_s", float), ("min_compute_ratio", float),
)
_RANK_FIGURE_NAMES = frozenset(c.name for c in RANK_FIGURES)
# A rank bucket's value, per figure: averaged and rounded as _RANK_SCORES_SQL does it.
_RANK_BUCKET_VALUE: dict[str, str] = {
    c.name: f"round(avg(r.{c.name}), 6) AS value" for c in RANK_FIGURES
}
_INCIDENTS_SQL = select_list(INCIDENT_COLUMNS)
_STEPS_SQL = select_list(STEP_COLUMNS)
_DEAD_LETTERS_SQL = select_list(DEAD_LETTER_COLUMNS)
_OPS_SQL = select_list(OP_COLUMNS)
_RANK_SCORES_SQL = ", ".join([
    "r.rank AS rank", "any(r.node) AS node", "count() AS steps",
    *(f"round(avg(r.{c.name}), 6) AS {c.name}" for c in RANK_FIGURES),
    "round(sum(r.caused_wait_s), 6) AS caused_wait_total_s",
    "round(min(r.compute_ratio), 6) AS min_compute_ratio",
])


def bucket_width(from_step: int, to_step: int, buckets: int) -> int:
    """Steps per bucket when [from_step, to_step] is cut into at most `buckets` equal ranges
    (the last may be shorter). One definition, so the buckets a store groups by are the
    columns a caller labels them with.

    >>> bucket_width(0, 9, 4), bucket_width(5, 5, 48), bucket_width(15, 59, 48)
    (3, 1, 1)
    """
    if buckets < 1:
        raise ValueError(f"expected at least one bucket, got {buckets!r}")
    return max(1, -(-(to_step - from_step + 1) // buckets))


def rank_figure(name: str) -> str:
    """`name` if it is one of `RANK_FIGURES`, else ValueError: a figure is picked from the
    table spec (never a caller's text in SQL), and both readers refuse an unknown one alike."""
    if name not in _RANK_FIGURE_NAMES:
        raise ValueError(f"expected one of {sorted(_RANK_FIGURE_NAMES)}, got {name!r}")
    return name


def _int(value: int) -> int:
    """An integer safe to format into SQL (LIMIT, OFFSET): refuses anything else."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def incident_from_row(row: Row) -> Row:
    """A stored incident row back in the shape of Incident v1 (suspects as objects)."""
    entities = row.pop("suspect_entities")
    confidences = row.pop("suspect_confidences")
    row["suspects"] = [
        {"entity": e, "confidence": c} for e, c in zip(entities, confidences, strict=False)
    ]
    stacks = row.pop("stacks", "")
    row["stacks"] = msgspec.json.decode(stacks) if stacks else None
    return {"v": 1, **row}


class Reader(Protocol):
    """What the API asks of storage. Implementations subclass it explicitly, so the type
    checker holds them to these signatures: `Queries` (ClickHouse) and
    `storage.testing.MemoryStore` (in memory). Errors of the store are StorageError."""

    @abstractmethod
    def ping(self) -> bool:
        """True when the store answers."""

    @abstractmethod
    def incidents(
        self, *, job: str | None = None, status: str | None = None, kind: str | None = None,
        since_ns: int | None = None, until_ns: int | None = None, limit: int = 100,
        offset: int = 0, before: tuple[int, str] | None = None,
    ) -> list[Row]:
        """Incidents (Incident v1 shape), newest opening first (ties by id, descending);
        the window [since, until) is on the opening time; `before` = (opened_ts_ns, id) of
        the last item of a previous page (keyset pagination)."""

    @abstractmethod
    def incident(self, incident_id: str) -> Row | None:
        """The newest state of one incident, or None."""

    @abstractmethod
    def detections(
        self, job: str, entity: str, from_step: int, to_step: int, limit: int = 10_000
    ) -> list[Row]:
        """One suspect's per-step evidence over [from_step, to_step], by step and kind."""

    @abstractmethod
    def jobs(self, *, limit: int = 100, offset: int = 0) -> list[Row]:
        """Every job with steps stored, by name, with its newest step and incident counts."""

    @abstractmethod
    def job(self, job: str) -> Row | None:
        """One job's summary, or None when no step of it is stored."""

    @abstractmethod
    def last_step(self, job: str) -> int | None:
        """The newest stored step of a job, or None for an unknown job."""

    @abstractmethod
    def steps(
        self, job: str, *, from_step: int | None = None, to_step: int | None = None,
        limit: int = 1000, stride: int = 1, irregular: list[str] | None = None,
    ) -> list[Row]:
        """A job's step series (`STEP_FIELDS`) in step order; see `Queries.steps`."""

    @abstractmethod
    def rank_scores(
        self, job: str, from_step: int, to_step: int, *, sort: RankSort = "rank",
        limit: int = 10_000,
    ) -> list[Row]:
        """Per-rank figures (`RANK_SCORE_FIELDS`) over steps [from_step, to_step]."""

    @abstractmethod
    def rank_buckets(
        self, job: str, from_step: int, to_step: int, buckets: int, figure: str, *,
        ranks: list[int] | None = None, limit: int = 100_000,
    ) -> list[Row]:
        """One per-rank figure averaged per rank and step bucket, as rows of rank, bucket and
        value, by rank and bucket; see `Queries.rank_buckets`."""

    @abstractmethod
    def op_steps(self, job: str, from_step: int, to_step: int, limit: int = 100) -> list[Row]:
        """The steps in [from_step, to_step] whose raw ops are stored, as step and ops (their
        count), in step order; see `Queries.op_steps`."""

    @abstractmethod
    def ops(self, job: str, steps: list[int], limit: int = 100_000) -> list[Row]:
        """The stored raw ops (`OP_COLUMNS`) of these steps, by step, rank and ord."""

    @abstractmethod
    def dead_letters(self, *, topic: str | None = None, limit: int = 100) -> list[Row]:
        """Stored dead letters, by topic and partition, newest offsets first."""


class Queries(Reader):
    """Read-only questions about jobs, steps, ranks and incidents."""

    def __init__(self, db: ClickHouse) -> None:
        self.db = db

    def ping(self) -> bool:
        return self.db.ping()

    # -- incidents ---------------------------------------------------------------------------

    def incidents(
        self,
        *,
        job: str | None = None,
        status: str | None = None,
        kind: str | None = None,
        since_ns: int | None = None,
        until_ns: int | None = None,
        limit: int = 100,
        offset: int = 0,
        before: tuple[int, str] | None = None,
    ) -> list[Row]:
        """Incidents, newest opening first (ties by id); the time window is on the opening
        time [since, until). `before` = (opened_ts_ns, id) of the last item of a previous page
        (keyset pagination: stable while new incidents arrive)."""
        where: list[str] = []
        params: dict[str, Any] = {}
        for name, value in (("job", job), ("status", status), ("kind", kind)):
            if value is not None:
                where.append(f"{name} = {{{name}:String}}")
                params[name] = value
        if since_ns is not None:
            where.append("opened_ts >= fromUnixTimestamp64Nano({since:Int64}, 'UTC')")
            params["since"] = since_ns
        if until_ns is not None:
            where.append("opened_ts < fromUnixTimestamp64Nano({until:Int64}, 'UTC')")
            params["until"] = until_ns
        if before is not None:
            where.append("(toUnixTimestamp64Nano(opened_ts), id) < ({b_ts:Int64}, {b_id:String})")
            params["b_ts"], params["b_id"] = before
        sql = (
            f"SELECT {_INCIDENTS_SQL} FROM {self.db.table('incidents')} FINAL"
            f" WHERE {' AND '.join(where) or '1'}"
            f" ORDER BY opened_ts DESC, id DESC LIMIT {_int(limit)} OFFSET {_int(offset)}"
        )
        return [incident_from_row(r) for r in self.db.rows(sql, params)]

    def incident(self, incident_id: str) -> Row | None:
        """The newest state of one incident, or None."""
        rows = self.db.rows(
            f"SELECT {_INCIDENTS_SQL} FROM {self.db.table('incidents')} FINAL"
            " WHERE id = {id:String} LIMIT 1",
            {"id": incident_id},
        )
        return incident_from_row(rows[0]) if rows else None

    def detections(
        self, job: str, entity: str, from_step: int, to_step: int, limit: int = 10_000
    ) -> list[Row]:
        """One suspect's per-step evidence over a step range (an incident's culprit)."""
        return self.db.rows(
            "SELECT step, kind, round(toFloat64(score), 6) AS score,"
            " round(toFloat64(excess_s), 6) AS excess_s"
            f" FROM {self.db.table('detections')} FINAL"
            " WHERE job = {job:String} AND entity = {entity:String}"
            " AND step >= {lo:UInt64} AND step <= {hi:UInt64}"
            f" ORDER BY step, kind LIMIT {_int(limit)}",
            {"job": job, "entity": entity, "lo": from_step, "hi": to_step},
        )

    # -- jobs and steps ----------------------------------------------------------------------

    def _job_summaries(self, where: str, params: dict[str, Any], tail: str) -> list[Row]:
        rows = self.db.rows(
            "SELECT job, count() AS steps, max(step) AS last_step,"
            " argMax(toUnixTimestamp64Nano(ts), step) AS last_ts_ns,"
            " argMax(step_time_s, step) AS step_time_s, argMax(baseline_s, step) AS baseline_s,"
            " argMax(delta, step) AS delta, argMax(irregular, step) AS irregular,"
            " argMax(n_ranks, step) AS n_ranks"
            f" FROM {self.db.table('job_steps')} FINAL WHERE {where} GROUP BY job {tail}",
            params,
        )
        if not rows:
            return rows
        counts = {
            r["job"]: r
            for r in self.db.rows(
                "SELECT job, countIf(status = 'open') AS open_incidents, count() AS incidents"
                f" FROM {self.db.table('incidents')} FINAL"
                " WHERE job IN {jobs:Array(String)} GROUP BY job",
                {"jobs": [r["job"] for r in rows]},
            )
        }
        for r in rows:
            c = counts.get(r["job"], {})
            r["open_incidents"] = c.get("open_incidents", 0)
            r["incidents"] = c.get("incidents", 0)
        return rows

    def jobs(self, *, limit: int = 100, offset: int = 0) -> list[Row]:
        """Every job with steps stored: its newest step, step time, δ and incident counts."""
        return self._job_summaries(
            "1", {}, f"ORDER BY job LIMIT {_int(limit)} OFFSET {_int(offset)}"
        )

    def job(self, job: str) -> Row | None:
        """One job's summary, or None when no step of it is stored."""
        rows = self._job_summaries("job = {job:String}", {"job": job}, "")
        return rows[0] if rows else None

    def last_step(self, job: str) -> int | None:
        """The newest stored step of a job, or None for an unknown job (no FINAL needed:
        duplicates do not change a maximum)."""
        rows = self.db.rows(
            f"SELECT count() AS n, max(step) AS last FROM {self.db.table('job_steps')}"
            " WHERE job = {job:String}",
            {"job": job},
        )
        return int(rows[0]["last"]) if rows and rows[0]["n"] else None

    def steps(
        self,
        job: str,
        *,
        from_step: int | None = None,
        to_step: int | None = None,
        limit: int = 1000,
        stride: int = 1,
        irregular: list[str] | None = None,
    ) -> list[Row]:
        """A job's step series in step order. Without `from_step` it is the newest `limit`
        steps up to `to_step`; `stride` keeps every stride-th step counted from `from_step`
        (long incidents' evidence); `irregular` keeps only those classes."""
        where = ["job = {job:String}"]
        params: dict[str, Any] = {"job": job}
        if from_step is not None:
            where.append("step >= {lo:UInt64}")
            params["lo"] = from_step
        if to_step is not None:
            where.append("step <= {hi:UInt64}")
            params["hi"] = to_step
        if stride > 1:
            where.append(f"(step - {{lo:UInt64}}) % {_int(stride)} = 0")
            params.setdefault("lo", 0)
        if irregular:
            where.append("irregular IN {irr:Array(String)}")
            params["irr"] = irregular
        order = "ASC" if from_step is not None else "DESC"
        rows = self.db.rows(
            f"SELECT {_STEPS_SQL} FROM {self.db.table('job_steps')} FINAL"
            f" WHERE {' AND '.join(where)} ORDER BY step {order} LIMIT {_int(limit)}",
            params,
        )
        return rows if from_step is not None else rows[::-1]

    # -- ranks -------------------------------------------------------------------------------

    def rank_scores(
        self,
        job: str,
        from_step: int,
        to_step: int,
        *,
        sort: RankSort = "rank",
        limit: int = 10_000,
    ) -> list[Row]:
        """Per-rank figures averaged over steps [from_step, to_step]: compute ratio vs peers,
        idle gap (host), wait and caused wait (how much this rank made its peers wait)."""
        return self.db.rows(
            f"SELECT {_RANK_SCORES_SQL} FROM {self.db.table('rank_steps')} AS r FINAL"
            " WHERE r.job = {job:String} AND r.step >= {lo:UInt64} AND r.step <= {hi:UInt64}"
            f" GROUP BY rank ORDER BY {_RANK_ORDER[sort]} LIMIT {_int(limit)}",
            {"job": job, "lo": from_step, "hi": to_step},
        )

    def rank_buckets(
        self,
        job: str,
        from_step: int,
        to_step: int,
        buckets: int,
        figure: str,
        *,
        ranks: list[int] | None = None,
        limit: int = 100_000,
    ) -> list[Row]:
        """One figure of `RANK_FIGURES` averaged per rank and step bucket, in one grouped
        read: a rank × step heatmap costs one query however many columns it has (a
        `rank_scores` per column did the same sums one column at a time). [from_step,
        to_step] is cut into `buckets` ranges of `bucket_width` steps; bucket b holds steps
        from_step + b * width on. Each value is what `rank_scores` over that bucket's steps
        gives for the figure (an average, rounded alike). `ranks` keeps only those ranks (a
        heatmap shows a few of a large job's); a rank without steps in a bucket has no row."""
        where = ["r.job = {job:String}", "r.step >= {lo:UInt64}", "r.step <= {hi:UInt64}"]
        params: dict[str, Any] = {
            "job": job, "lo": from_step, "hi": to_step,
            "width": bucket_width(from_step, to_step, buckets),
        }
        if ranks is not None:
            where.append("r.rank IN {ranks:Array(UInt32)}")
            params["ranks"] = ranks
        value = _RANK_BUCKET_VALUE[rank_figure(figure)]
        return self.db.rows(
            "SELECT r.rank AS rank, intDiv(r.step - {lo:UInt64}, {width:UInt64}) AS bucket,"
            f" {value} FROM {self.db.table('rank_steps')} AS r FINAL WHERE {' AND '.join(where)}"
            f" GROUP BY rank, bucket ORDER BY rank, bucket LIMIT {_int(limit)}",
            params,
        )

    # -- raw ops -----------------------------------------------------------------------------

    def op_steps(self, job: str, from_step: int, to_step: int, limit: int = 100) -> list[Row]:
        """The steps of a range whose raw ops are stored (the worker keeps irregular and
        every Nth step, for 7 days), with how many ops each has: what a trace can show, and
        how big it would be, before any op is read."""
        return self.db.rows(
            f"SELECT step, count() AS ops FROM {self.db.table('ops')} FINAL"
            " WHERE job = {job:String} AND step >= {lo:UInt64} AND step <= {hi:UInt64}"
            f" GROUP BY step ORDER BY step LIMIT {_int(limit)}",
            {"job": job, "lo": from_step, "hi": to_step},
        )

    def ops(self, job: str, steps: list[int], limit: int = 100_000) -> list[Row]:
        """The raw ops of some steps of a job, by step, rank and position (a trace's input)."""
        return self.db.rows(
            f"SELECT {_OPS_SQL} FROM {self.db.table('ops')} FINAL"
            " WHERE job = {job:String} AND step IN {steps:Array(UInt64)}"
            f" ORDER BY step, rank, ord LIMIT {_int(limit)}",
            {"job": job, "steps": steps},
        )

    # -- dead letters ------------------------------------------------------------------------

    def dead_letters(self, *, topic: str | None = None, limit: int = 100) -> list[Row]:
        """Stored dead letters, newest offsets first (for operators and tests)."""
        where, params = ("topic = {topic:String}", {"topic": topic}) if topic else ("1", {})
        return self.db.rows(
            f"SELECT {_DEAD_LETTERS_SQL} FROM {self.db.table('dead_letters')} FINAL"
            f" WHERE {where}"
            f" ORDER BY topic, partition, offset DESC LIMIT {_int(limit)}",
            params,
        )
