"""storage.arrow: Arrow types derived from the ClickHouse types, checked column chunks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from storage.arrow import LC, SCHEMAS, TS, arrow_schema, arrow_type, column
from storage.tables import INCIDENTS, TABLES, Interned


def test_every_table_has_an_arrow_schema_of_its_written_columns() -> None:
    for table in TABLES:
        assert SCHEMAS[table.name].names == [c.name for c in table.written]
        assert "inserted_at" not in SCHEMAS[table.name].names  # the server fills it
    schema = arrow_schema(INCIDENTS)
    assert schema.field("suspect_entities").type == pa.list_(pa.string())
    assert schema.field("opened_ts").type == TS and schema.field("job").type == LC
    assert schema.field("resolved_step").type == pa.int64()


def test_an_unknown_clickhouse_type_is_refused_by_name() -> None:
    assert arrow_type("Nullable(Float32)") == pa.float32()
    with pytest.raises(ValueError, match=r"'Decimal\(9, 2\)'"):
        arrow_type("Decimal(9, 2)")


def test_columns_broadcast_scalars_and_check_length_range_and_nulls() -> None:
    assert column(3, 4, pa.uint32()).to_pylist() == [3, 3, 3, 3]
    assert column("j", 2, LC).dictionary.to_pylist() == ["j"]
    with pytest.raises(ValueError, match="2 values where the step has 3 rows"):
        column(np.zeros(2), 3, pa.float32())
    with pytest.raises(pa.ArrowInvalid):
        column(np.array([1, -1]), 2, pa.uint32())  # a negative rank
    with pytest.raises(ValueError, match="1 missing"):
        column(["a", None], 2, pa.string())
    assert column([None, 4], 2, pa.int64(), nullable=True).to_pylist() == [None, 4]


def test_interned_strings_keep_a_duplicate_free_dictionary() -> None:
    arr = column(Interned(np.array([0, 1, 2, 1]), ["n", "n", "m"]), 4, LC)
    assert arr.to_pylist() == ["n", "n", "m", "n"]
    assert sorted(arr.dictionary.to_pylist()) == ["m", "n"]
    with pytest.raises(ValueError, match="out of range"):
        column(Interned(np.array([3]), ["n"]), 1, LC)
