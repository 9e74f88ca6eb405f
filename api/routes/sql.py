"""POST /v1/sql: one read-only SQL statement against Flare's ClickHouse, for the on-call.

The embedded store belongs to the worker (one process owns a chDB directory), so this route
is how `flare sql` and anyone else reach it while Flare runs. It is on by default, like the
rest of /v1, because what protects it does not depend on the caller: ClickHouse's own
read-only mode on a session of its own (no write, DDL, KILL or setting change, not even in
the statement's own SETTINGS), one statement parsed by ClickHouse, and limits on rows,
bytes, seconds, memory and threads (`storage.adhoc` says how, and which holes of the
embedded engine it closes). The optional API key guards it with the rest of /v1.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from api.problems import ProblemError, responses
from storage.adhoc import READS, ReadOnlySQL, SQLRefused

router = APIRouter(prefix="/sql", tags=["sql"])


async def get_sql(request: Request) -> ReadOnlySQL:  # app.state only: no thread (deps.py)
    sql: ReadOnlySQL | None = getattr(request.app.state, "sql", None)
    if sql is None:
        raise ProblemError(404, "this API runs no SQL: it was started without a ClickHouse "
                                "session for it (an in-memory store)")
    return sql


SQLDep = Annotated[ReadOnlySQL, Depends(get_sql)]


class SQLRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=100_000,
                       description=f"one statement: {', '.join(READS)}; Flare's database is "
                       "the default one (`SELECT * FROM incidents`)")


class SQLColumn(BaseModel):
    name: str
    type: str = Field(description="the ClickHouse type")


class SQLResult(BaseModel):
    columns: list[SQLColumn]
    rows: list[list[Any]] = Field(description="one list of values per row, in column order; "
                                  "times in ISO 8601, NaN as null")
    truncated: bool = Field(description="rows were left out: more than max_rows, or more "
                            "than the API's byte budget")
    max_rows: int


@router.post("", response_model=SQLResult, responses=responses(400, 403, 404, 422, 503))
def run_sql(body: SQLRequest, sql: SQLDep) -> SQLResult:
    """Run one read-only statement. A statement that is not a read is a 403; a syntax
    error, an unknown table or a limit reached (time, memory) is a 400 with ClickHouse's
    own message."""
    try:
        answer = sql.run(body.query)
    except SQLRefused as exc:
        raise ProblemError(403 if exc.forbidden else 400, str(exc)) from None
    return SQLResult(
        columns=[SQLColumn(name=n, type=t) for n, t in answer.columns],
        rows=answer.rows, truncated=answer.truncated, max_rows=answer.max_rows,
    )
