"""The pure parts of `storage.adhoc`: JSON-ready values, the settings' order, ClickHouse's
message without its wrapping (the engine itself: tests/integration/test_sql.py)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import uuid
from decimal import Decimal

import msgspec
from clickhouse_connect.driver.exceptions import DatabaseError

from storage.adhoc import Limits, _reason, plain


def test_values_become_what_json_carries() -> None:
    utc = dt.datetime(2026, 1, 31, 12, 0, 0, 500_000, tzinfo=dt.UTC)
    row = [None, True, 2**64 - 1, 1.5, float("nan"), float("-inf"), "é", b"a\xffb",
           Decimal("1.25"), uuid.UUID(int=1), ipaddress.ip_address("10.0.0.1"), utc,
           dt.date(2026, 1, 31), {1: [1, (2, "x")]}, dt.timedelta(seconds=90)]
    assert [plain(v) for v in row] == [
        None, True, 2**64 - 1, 1.5, None, None, "é", "a\\xffb", "1.25",
        "00000000-0000-0000-0000-000000000001", "10.0.0.1", "2026-01-31T12:00:00.500000+00:00",
        "2026-01-31", {"1": [1, [2, "x"]]}, "0:01:30"]
    msgspec.json.encode([plain(v) for v in row])  # all of it encodes


def test_readonly_is_the_last_setting_applied() -> None:
    settings = Limits(rows=7, json_bytes=100, seconds=3).settings()
    assert list(settings)[-1] == "readonly" and settings["readonly"] == 1
    assert settings["max_result_rows"] == 7 and settings["max_execution_time"] == 3
    assert settings["max_result_bytes"] == 800 and settings["result_overflow_mode"] == "break"


def test_clickhouses_message_is_kept_and_its_wrapping_dropped() -> None:
    nested = DatabaseError(
        "Code: 164. DB::Exception: Code: 164. DB::Exception: Cannot modify 'readonly' setting "
        "in readonly mode. (READONLY) (version 26.9.2.1). (READONLY)", code=164, name="READONLY")
    assert _reason(nested) == ("ClickHouse: Cannot modify 'readonly' setting in readonly mode. "
                               "(READONLY)")
    parsed = DatabaseError(
        "Code: 62. DB::Exception: Syntax error (Multi-statements are not allowed): failed at "
        "position 9: ; SELECT 2. : In scope SELECT formatQuery('SELECT 1; SELECT 2'). "
        "(SYNTAX_ERROR)", code=62, name="SYNTAX_ERROR")
    assert _reason(parsed) == ("ClickHouse: Syntax error (Multi-statements are not allowed): "
                               "failed at position 9: ; SELECT 2. (SYNTAX_ERROR)")
    long = _reason(DatabaseError("Code: 62. DB::Exception: " + "x" * 5000, code=62))
    assert len(long) < 700 and long.endswith("…")
