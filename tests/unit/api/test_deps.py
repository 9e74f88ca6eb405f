"""api.deps: times given as ns or ISO 8601, and page cursors, parsed or refused by field."""

from __future__ import annotations

import pytest

from api.deps import I64_MAX, decode_cursor, encode_cursor, parse_time
from api.problems import ProblemError


@pytest.mark.parametrize(("text", "ns"), [
    ("0", 0),
    (" 1790000200000000000 ", 1_790_000_200_000_000_000),
    ("2026-09-21T14:16:40Z", 1_790_000_200_000_000_000),
    ("2026-09-21T16:16:40+02:00", 1_790_000_200_000_000_000),
    ("2026-09-21T14:16:40", 1_790_000_200_000_000_000),  # naive: UTC
    ("2026-09-21T14:16:40.000001Z", 1_790_000_200_000_001_000),
])
def test_times_as_ns_or_iso(text: str, ns: int) -> None:
    assert parse_time("since", text) == ns
    assert parse_time("since", None) is None


@pytest.mark.parametrize("text", ["-5", str(I64_MAX + 1), "yesterday", "9999-12-31",
                                  "0001-01-01T00:00:00+01:00"])
def test_bad_times_are_422_naming_the_field(text: str) -> None:
    with pytest.raises(ProblemError) as err:
        parse_time("until", text)
    assert err.value.status == 422 and err.value.errors is not None
    assert err.value.errors[0].field == "until"


def test_cursors_round_trip_and_anything_else_is_refused() -> None:
    assert decode_cursor(encode_cursor(12, "job/gpu/rank:1/3")) == (12, "job/gpu/rank:1/3")
    assert decode_cursor(None) is None
    for bad in ("!!", "WzEsMiwzXQ", encode_cursor(-1, "x"), "bnVsbA"):
        with pytest.raises(ProblemError, match="cursor"):
            decode_cursor(bad)
