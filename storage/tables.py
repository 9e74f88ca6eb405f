"""One home for the columns of each ClickHouse table Flare writes.

The DDL in infra/*.sql creates the tables; this module states, once per table, which columns
it has (in DDL order), their types exactly as ClickHouse reports them in `system.columns`, and
where the writer takes each value from. Everything else is derived from it: the writer's
Arrow schema and INSERT column list (`storage.arrow`), the reader's whole-row SELECT lists
and their Python types (`storage.reader`, and through it the API's row models), and the
in-memory fake (`storage.testing`). A test checks every spec against the DDL after the
migrations ran (tests/integration/test_storage_tables.py), so a column change is two edits:
a new numbered migration in infra/ and the column here.

A column's `source` says how its value is taken from the object the writer is given for that
table (`Table.root`): a dotted attribute path, where a list along the path yields one value
per item; a callable for computed values; or None for a column the server fills itself
(`inserted_at DEFAULT now()`), which is never written. This module is pure (no pyarrow, no
driver) so the API and the fake can use it without the writer's dependencies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from schemas.frame import StepFrame
from schemas.rankstep import OP_KINDS
from schemas.report import StepReport
from schemas.wire import IncidentV1

Source = str | Callable[[Any], Any] | None

LC = "LowCardinality(String)"
TS = "DateTime64(9, 'UTC')"  # read back as integer nanoseconds, `<name>_ns`
_NS_TYPES = (TS,)


def take(obj: Any, source: str | Callable[[Any], Any]) -> Any:
    """The value(s) `source` names in `obj`; a list (of incidents, of detections) gives one
    value per item, so `take(incidents, "suspects.entity")` is a list of lists.

    >>> from types import SimpleNamespace as NS
    >>> take(NS(a=NS(b=[NS(c=1), NS(c=2)])), "a.b.c")
    [1, 2]
    """
    if isinstance(obj, list):
        return [take(item, source) for item in obj]
    if callable(source):
        return source(obj)
    head, _, rest = source.partition(".")
    value = getattr(obj, head)
    return take(value, rest) if rest else value


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its name, its ClickHouse type as `system.columns` shows it, its source."""

    name: str
    type: str
    source: Source = ""  # "" = the attribute of the same name

    @property
    def written(self) -> bool:
        """False for a column the server fills (DEFAULT), which inserts leave out."""
        return self.source is not None

    @property
    def nullable(self) -> bool:
        return self.type.startswith("Nullable(")

    @property
    def read_name(self) -> str:
        """The name a reader returns it under: times come back as integer ns (`ts_ns`)."""
        return f"{self.name}_ns" if self.type in _NS_TYPES else self.name

    @property
    def read_type(self) -> Any:
        """The Python type of the value a reader returns (what the API models show)."""
        return _python_type(self.type)

    def take(self, root: Any) -> Any:
        """This column's value(s) from the table's root object (or a list of them)."""
        if self.source is None:
            raise ValueError(f"{self.name} is filled by the server, not written")
        return take(root, self.source or self.name)


def _python_type(ch_type: str) -> Any:
    if ch_type.startswith("Nullable("):
        return _python_type(ch_type[len("Nullable("):-1]) | None
    if ch_type.startswith("Array("):
        return list[_python_type(ch_type[len("Array("):-1])]  # type: ignore[misc]
    if ch_type.startswith(("Float",)):
        return float
    if ch_type.startswith(("UInt", "Int")) or ch_type in _NS_TYPES:
        return int
    if ch_type == "Bool":
        return bool
    if ch_type in ("String", LC):
        return str
    raise ValueError(f"no Python type for ClickHouse type {ch_type!r}: add it to storage.tables")


@dataclass(frozen=True, slots=True)
class Table:
    """A table's columns in DDL order, its ORDER BY key (the natural key a ReplacingMergeTree
    keeps one row per), and what the writer hands it (`root`)."""

    name: str
    root: str
    key: tuple[str, ...]
    columns: tuple[Column, ...]

    @property
    def written(self) -> tuple[Column, ...]:
        return tuple(c for c in self.columns if c.written)

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"{self.name} has no column {name!r}")


def stacks_json(inc: IncidentV1) -> str:
    """A hang's merged stacks as JSON text ('' when it has none): read whole, never queried
    by part, so one String column rather than nested arrays."""
    return msgspec.json.encode(inc.stacks).decode() if inc.stacks else ""


def incident_version(inc: IncidentV1) -> int:
    """Newer states of one incident get larger versions (ReplacingMergeTree keeps the max):
    a later step wins, and at the same step `resolved` wins over `open`."""
    step = max(inc.last_step, inc.resolved_step or 0, 0)
    return 2 * step + (inc.status == "resolved")


@dataclass(frozen=True, slots=True)
class OpRows:
    """The root of the ops table: a kept frame's ops one row each, with the per-rank values
    (rank, node, t_start) repeated per op through `rank_index`."""

    frame: StepFrame
    ts_ns: int
    rank_index: np.ndarray  # (N,) the rank row of every op
    ord: np.ndarray  # (N,) the op's position in its rank's message

    @classmethod
    def of(cls, report: StepReport) -> OpRows:
        f = report.frame
        if f is None:
            raise ValueError("ops: the report kept no frame")
        if f.off.shape != (f.n_ranks + 1,) or f.off[-1] != f.n_ops:
            raise ValueError(f"ops: frame offsets do not cover its {f.n_ops} ops")
        first = np.repeat(np.asarray(f.off[:-1], np.int64), np.diff(f.off))
        return cls(f, report.ts_ns, f.op_rank_index(), np.arange(f.n_ops, dtype=np.int64) - first)


class Interned:
    """Strings given as codes into a table (how StepFrame stores names, groups, nodes), kept
    so for LowCardinality columns instead of being expanded to one string per row."""

    __slots__ = ("codes", "table")

    def __init__(self, codes: np.ndarray, table: list[str] | tuple[str, ...]) -> None:
        self.codes = codes
        self.table = table


INSERTED_AT = Column("inserted_at", "DateTime", None)  # server clock; drives the TTLs

JOB_STEPS = Table("job_steps", "StepReport", ("job", "step"), (
    Column("job", LC),
    Column("step", "UInt64"),
    Column("ts", TS, "ts_ns"),
    Column("n_ranks", "UInt32"),
    Column("n_missing", "UInt32"),
    Column("step_time_s", "Float64"),
    Column("baseline_s", "Float64"),
    Column("delta", "Float64"),
    Column("irregular", LC),
    Column("level_shift", "Bool"),
    Column("n_detections", "UInt32", lambda r: len(r.detections)),
    INSERTED_AT,
))

RANK_STEPS = Table("rank_steps", "StepReport (one row per report.ranks row)",
                   ("job", "step", "rank"), (
    Column("job", LC),
    Column("step", "UInt64"),
    Column("rank", "UInt32", "ranks.rank"),
    Column("ts", TS, "ts_ns"),
    Column("node", LC, "ranks.node"),
    Column("step_s", "Float32", "ranks.step_s"),
    Column("compute_s", "Float32", "ranks.compute_s"),
    Column("comm_s", "Float32", "ranks.comm_s"),
    Column("gap_s", "Float32", "ranks.gap_s"),
    Column("wait_s", "Float32", "ranks.wait_s"),
    Column("caused_wait_s", "Float32", "ranks.caused_wait_s"),
    Column("compute_ratio", "Float32", "ranks.compute_ratio"),
    Column("n_ops", "UInt32", "ranks.n_ops"),
    INSERTED_AT,
))

GROUP_STEPS = Table("group_steps", "StepReport (one row per report.groups row)",
                    ("job", "step", "group_name"), (
    Column("job", LC),
    Column("step", "UInt64"),
    Column("group_name", LC, "groups.group"),
    Column("ts", TS, "ts_ns"),
    Column("n_members", "UInt32", "groups.n_members"),
    Column("n_instances", "UInt32", "groups.n_instances"),
    Column("comm_s", "Float32", "groups.comm_s"),
    Column("transfer_s", "Float32", "groups.transfer_s"),
    Column("wait_s", "Float32", "groups.wait_s"),
    Column("transfer_ratio", "Float32", "groups.transfer_ratio"),
    INSERTED_AT,
))

OPS = Table("ops", "OpRows (one row per op of the report's kept frame)",
            ("job", "step", "rank", "ord"), (
    Column("job", LC, "frame.job"),
    Column("step", "UInt64", "frame.step"),
    Column("rank", "UInt32", lambda o: o.frame.rank[o.rank_index]),
    Column("ord", "UInt32"),
    Column("ts", TS, "ts_ns"),
    Column("node", LC, lambda o: Interned(o.frame.node[o.rank_index], o.frame.nodes)),
    Column("t_start", TS, lambda o: o.frame.t_start_ns[o.rank_index]),
    Column("kind", LC, lambda o: Interned(o.frame.op_kind, OP_KINDS)),
    Column("name", LC, lambda o: Interned(o.frame.op_name, o.frame.names)),
    Column("group_name", LC, lambda o: Interned(o.frame.op_group, o.frame.groups)),
    Column("seq", "Int64", "frame.op_seq"),
    Column("start_ns", "Int64", "frame.op_start_ns"),
    Column("dur_ns", "Int64", "frame.op_dur_ns"),
    Column("bytes", "Int64", "frame.op_bytes"),
    INSERTED_AT,
))

DETECTIONS = Table("detections", "StepReport (one row per report.detections item)",
                   ("job", "entity", "kind", "step"), (
    Column("job", LC),
    Column("entity", "String", "detections.entity"),
    Column("kind", LC, "detections.kind"),
    Column("step", "UInt64"),
    Column("ts", TS, "ts_ns"),
    Column("score", "Float32", "detections.score"),
    Column("excess_s", "Float32", "detections.excess_s"),
    INSERTED_AT,
))

INCIDENTS = Table("incidents", "list[IncidentV1]", ("job", "id"), (
    Column("id", "String"),
    Column("job", LC),
    Column("status", LC),
    Column("kind", LC),
    Column("culprit", "String"),
    Column("suspect_entities", "Array(String)", "suspects.entity"),
    Column("suspect_confidences", "Array(Float64)", "suspects.confidence"),
    Column("onset_step", "Int64"),
    Column("opened_step", "Int64"),
    Column("opened_ts", TS, "opened_ts_ns"),
    Column("last_step", "Int64"),
    Column("resolved_step", "Nullable(Int64)"),
    Column("slowdown", "Float64"),
    Column("lost_gpu_seconds", "Float64"),
    Column("lost_gpu_seconds_per_step", "Float64"),
    Column("evidence_steps", "Int64"),
    Column("summary", "String"),
    Column("stacks", "String", stacks_json),
    Column("version", "UInt64", incident_version),  # ReplacingMergeTree(version)
    INSERTED_AT,
))

DEAD_LETTERS = Table("dead_letters", "list[DeadLetterV1]", ("topic", "partition", "offset"), (
    Column("topic", LC),
    Column("partition", "Int32"),
    Column("offset", "Int64"),
    Column("reason", "String"),
    Column("payload_b64", "String"),
    INSERTED_AT,
))

# Write order: steps before incidents, so a reader that sees an incident finds its evidence.
TABLES: tuple[Table, ...] = (
    JOB_STEPS, RANK_STEPS, GROUP_STEPS, OPS, DETECTIONS, INCIDENTS, DEAD_LETTERS
)
BY_NAME: dict[str, Table] = {t.name: t for t in TABLES}
VIEWS: tuple[str, ...] = (
    "v_job_steps", "v_rank_scores", "v_open_incidents", "v_incident_cost_daily",
)
