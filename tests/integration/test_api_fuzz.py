"""Property: whatever a client sends, the API answers 2xx or a 4xx problem+json, never a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import create_app
from storage.client import ClickHouse, connect
from storage.migrations import apply_schema
from storage.testing import SAMPLE_JOB as JOB
from storage.testing import load_sample
from storage.writer import Sink

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROUTES = ["/v1/incidents", "/v1/incidents/{x}", "/v1/jobs", "/v1/jobs/{x}",
          "/v1/jobs/{x}/steps", "/v1/jobs/{x}/ranks", "/healthz", "/readyz"]
PARAMS = ["job", "status", "kind", "since", "until", "limit", "offset", "cursor", "max_points",
          "from_step", "to_step", "irregular", "last", "step", "sort", "x"]
values = st.one_of(
    st.text(max_size=40),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["open", "gpu", "rank", "caused_wait", "2026-09-21T14:16:40Z", JOB, "0",
                     "1000", "1001", "WzEsImEiXQ", "spike", "", "null", "[]", "%00"]),
)
segments = st.one_of(st.text(max_size=40), st.sampled_from([JOB, "quiet", "many", "..", "%2F"]))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db: ClickHouse = connect(f"chdb://{tmp_path_factory.mktemp('chdb')}?database=test_fuzz")
    apply_schema(db)
    load_sample(Sink(db))
    yield TestClient(create_app(db), raise_server_exceptions=False)
    db.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(route=st.sampled_from(ROUTES), segment=segments,
       params=st.lists(st.tuples(st.sampled_from(PARAMS), values), max_size=5))
def test_any_request_gets_an_answer_or_a_problem(
    client: TestClient, route: str, segment: str, params: list[tuple[str, str]]
) -> None:
    url = route.replace("{x}", quote(segment, safe="/"))
    resp = client.get(url, params=params)
    assert resp.status_code < 500, (url, params, resp.text)
    if resp.status_code >= 400:
        assert resp.headers["content-type"] == "application/problem+json"
        body = resp.json()
        assert body["status"] == resp.status_code and body.get("detail")
    else:
        resp.json()
