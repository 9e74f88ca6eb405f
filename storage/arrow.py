"""Rows to Arrow: each table's Arrow schema (derived from `storage.tables`) and checked
column chunks that the writer joins into one Arrow table per INSERT.

Values are converted and checked when they are added (range, length, nulls), so a bad report
is refused alone with the table and column named, instead of poisoning a whole flush. Strings
of LowCardinality columns become dictionary arrays; ones the frame already interned
(`tables.Interned`) stay interned instead of being expanded to one string per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]  # ships no type information

from storage.tables import TABLES, Interned, Table

STR = pa.string()
LC = pa.dictionary(pa.int32(), pa.string())  # LowCardinality(String)
TS = pa.timestamp("ns", tz="UTC")  # DateTime64(9, 'UTC')
F32, F64 = pa.float32(), pa.float64()
U32, U64, I32, I64 = pa.uint32(), pa.uint64(), pa.int32(), pa.int64()

_ARROW: dict[str, pa.DataType] = {
    "String": STR, "LowCardinality(String)": LC, "DateTime64(9, 'UTC')": TS, "Bool": pa.bool_(),
    "Float32": F32, "Float64": F64, "UInt32": U32, "UInt64": U64, "Int32": I32, "Int64": I64,
}


def arrow_type(ch_type: str) -> pa.DataType:
    """The Arrow type that `insert_arrow` sends for a ClickHouse column type."""
    if ch_type.startswith("Nullable("):
        return arrow_type(ch_type[len("Nullable("):-1])
    if ch_type.startswith("Array("):
        return pa.list_(arrow_type(ch_type[len("Array("):-1]))
    try:
        return _ARROW[ch_type]
    except KeyError:
        raise ValueError(
            f"no Arrow type for ClickHouse type {ch_type!r}: add it to storage.arrow"
        ) from None


def arrow_schema(table: Table) -> pa.Schema:
    """The written columns of a table; its names are the INSERT's column list."""
    return pa.schema([(c.name, arrow_type(c.type)) for c in table.written])


SCHEMAS: dict[str, pa.Schema] = {t.name: arrow_schema(t) for t in TABLES}


def _lc(value: Any, n: int) -> pa.Array:
    """A dictionary array with a duplicate-free dictionary (ClickHouse refuses duplicates)."""
    if isinstance(value, str):
        return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([value]))
    if isinstance(value, Interned):
        uniq, inverse = np.unique(np.asarray(value.table, dtype=object), return_inverse=True)
        codes = np.asarray(value.codes, dtype=np.int64)
        if codes.size and (codes.min() < 0 or codes.max() >= len(value.table)):
            raise ValueError("string code out of range of its table")
        return pa.DictionaryArray.from_arrays(
            pa.array(inverse.astype(np.int32)[codes]), pa.array(uniq.tolist(), STR)
        )
    return pa.array(list(value), STR).dictionary_encode()


def _numeric(value: Any, n: int, dtype: type) -> np.ndarray:
    """n numbers: a scalar is broadcast, an array must have exactly n values."""
    a = np.asarray(value)
    if a.ndim == 0:
        return np.full(n, a, dtype=dtype)
    if a.shape != (n,):
        raise ValueError(f"{a.shape[0] if a.ndim else 0} values where the step has {n} rows")
    return a.astype(dtype, copy=False)


def column(value: Any, n: int, typ: pa.DataType, nullable: bool = False) -> pa.Array:
    """One column chunk of n rows; scalars are broadcast; checks range and length."""
    if typ == LC:
        arr = _lc(value, n)
    elif typ == STR:
        arr = pa.array([value] * n if isinstance(value, str) else list(value), STR)
    elif isinstance(value, pa.Array):
        arr = value.cast(typ)
    elif pa.types.is_list(typ):
        arr = pa.array(list(value), typ)
    elif pa.types.is_floating(typ):
        arr = pa.array(_numeric(value, n, np.float32 if typ == F32 else np.float64))
    elif typ == pa.bool_():
        arr = pa.array(_numeric(value, n, np.bool_))
    elif typ == TS:
        arr = pa.array(_numeric(value, n, np.int64), type=TS)
    elif nullable:  # a null needs an object array; a safe cast still refuses overflows
        arr = pa.array(list(value), I64).cast(typ)
    else:  # integers: a safe cast refuses negatives for unsigned columns and overflows
        arr = pa.array(_numeric(value, n, np.int64)).cast(typ)
    if len(arr) != n:
        raise ValueError(f"{len(arr)} values where the step has {n} rows")
    if arr.null_count and not nullable:
        raise ValueError(f"{arr.null_count} missing values (null)")
    return arr


@dataclass(slots=True)
class Chunk:
    """Checked column chunks of some rows of one table, not yet in its buffer."""

    buffer: Buffer
    n: int
    arrays: list[pa.Array]


class Buffer:
    """Column chunks of one table, appended per report, joined into one Arrow table per flush."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.schema = arrow_schema(table)
        self._columns = table.written
        self.chunks: list[list[pa.Array]] = [[] for _ in self._columns]
        self.rows = 0

    def build(self, n: int, root: Any) -> Chunk:
        """Convert and check n rows taken from `root` (see `storage.tables`) without adding
        them, so a report is all or nothing; errors name the table and column."""
        built: list[pa.Array] = []
        for col, f in zip(self._columns, self.schema, strict=True):
            try:
                built.append(column(col.take(root), n, f.type, col.nullable))
            except (ValueError, TypeError, KeyError, AttributeError, OverflowError,
                    pa.ArrowException) as exc:
                raise ValueError(f"{self.table.name}.{col.name}: {exc}") from exc
        return Chunk(self, n, built)

    def commit(self, chunk: Chunk) -> None:
        for chunks, arr in zip(self.chunks, chunk.arrays, strict=True):
            chunks.append(arr)
        self.rows += chunk.n

    def append(self, n: int, root: Any) -> None:
        if n:
            self.commit(self.build(n, root))

    def to_arrow(self) -> pa.Table:
        columns = [pa.chunked_array(c, type=f.type) for c, f in zip(self.chunks, self.schema,
                                                                   strict=True)]
        table = pa.Table.from_arrays(columns, schema=self.schema)
        return table.unify_dictionaries().combine_chunks()

    def clear(self) -> None:
        self.chunks = [[] for _ in self._columns]
        self.rows = 0

    def extend(self, later: Buffer) -> None:
        """Append the rows of `later` (a buffer of the same table) after this one's: rows a
        failed write hands back go before those added meanwhile, so one INSERT keeps the order
        they were produced in (ReplacingMergeTree without a version keeps the last)."""
        if later.table is not self.table:
            raise ValueError(f"cannot join rows of {later.table.name} to {self.table.name}")
        for chunks, more in zip(self.chunks, later.chunks, strict=True):
            chunks.extend(more)
        self.rows += later.rows
