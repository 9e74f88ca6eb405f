"""Schemathesis over the API's own OpenAPI document (issue #16): every operation it
publishes, with inputs that fit the schema and inputs that do not (schemathesis' positive
and negative modes), plus the ids of the jobs and incidents that exist, against the app over
embedded chDB loaded with the sample data.

No answer may be a 5xx, and every answer must be one the document declares: its status
code, its content type and its body's schema (bad input: a problem+json 4xx).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from storage.adhoc import open_readonly
from tests.integration.conftest import sample_store

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
EXAMPLES = 80  # per operation and mode; the same cases on every run (derandomized)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    url = f"chdb://{tmp_path_factory.mktemp('chdb')}?database=test_st"
    with sample_store(url) as db:
        sql = open_readonly(url)  # POST /v1/sql is fuzzed with a session, as the worker serves it
        yield create_app(db, sql=sql)
        sql.close()


def existing(app: Any) -> dict[str, list[str]]:
    """Path parameter values that name something in the sample data: random ones mostly
    get 404, and the answers with a body are the ones whose schema matters."""
    client = TestClient(app)
    jobs = [j["job"] for j in client.get("/v1/jobs").json()["items"]]
    incidents = [i["id"] for i in client.get("/v1/incidents", params={"limit": 100}).json()
                 ["items"]]
    assert jobs and incidents, "the sample data has jobs and incidents"
    return {"job": jobs, "incident_id": incidents}


def fuzz(cases_of: st.SearchStrategy[Any], what: str, cases: Counter[str],
         statuses: Counter[int]) -> None:
    """Run one operation's cases (hypothesis shrinks a failing one), counting them."""

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=(Phase.explicit, Phase.generate, Phase.shrink),
              suppress_health_check=list(HealthCheck))
    @given(cases_of)
    def call(case: Any) -> None:
        response = case.call_and_validate(checks=CHECKS)
        cases[what] += 1
        statuses[response.status_code] += 1

    call()


def test_schemathesis_finds_no_server_error_and_no_answer_outside_the_schema(app: Any) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    known = existing(app)
    cases: Counter[str] = Counter()
    statuses: Counter[int] = Counter()

    operations = []
    for result in schema.get_all_operations():
        op = result.ok()
        operations.append(op.label)
        takes_input = any(True for _ in op.iter_parameters()) or bool(op.body)
        params = [p.name for p in op.iter_parameters() if p.location == "path"]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and not takes_input:
                continue  # nothing to make invalid
            strategies = [op.as_strategy(generation_mode=mode)]
            if mode is GenerationMode.POSITIVE and len(params) == 1:
                strategies += [op.as_strategy(path_parameters={params[0]: value})
                               for value in known[params[0]]]

            fuzz(st.one_of(strategies), f"{op.label} {mode.value}", cases, statuses)

    total = sum(cases.values())
    print(f"\nschemathesis: {total} cases over {len(cases)} operation-modes; "
          f"statuses {dict(sorted(statuses.items()))}")
    assert not [s for s in statuses if s >= 500]
    assert {k.rsplit(" ", 1)[0] for k in cases} == set(operations), "each one was called"
    assert statuses[200] and any(400 <= s < 500 for s in statuses)
