"""/v1/dead-letters and the health routes an orchestrator probes."""

from __future__ import annotations

from typing import get_args

import pytest
from fastapi.testclient import TestClient

from api.routes.dead_letters import InputTopic
from schemas.topics import CONSUMED_TOPICS
from storage.testing import MemoryStore, make_dead_letter

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_dead_letters_say_why_and_keep_the_bytes(store: MemoryStore, client: TestClient,
                                                  problem) -> None:
    for offset in (3, 9, 5):
        store.add_dead_letter(make_dead_letter(offset, reason=f"$.rank: bad {offset}"))
    store.flush()
    got = client.get("/v1/dead-letters", params={"topic": "flare.steps.v1", "limit": 2}).json()
    assert [(d["offset"], d["reason"]) for d in got] == [(9, "$.rank: bad 9"),
                                                         (5, "$.rank: bad 5")]
    assert got[0]["payload_b64"] == "e30="
    assert client.get("/v1/dead-letters", params={"topic": "flare.jobs.v1"}).json() == []
    bad = problem(client.get("/v1/dead-letters", params={"topic": "nope"}), 422)
    assert "flare.steps.v1" in bad["detail"]
    assert get_args(InputTopic) == CONSUMED_TOPICS  # one list of the topics read


def test_liveness_and_readiness_answer_head_too(client: TestClient) -> None:
    for path in ("/livez", "/healthz", "/readyz"):
        assert client.get(path).status_code == 200
        head = client.head(path)
        assert head.status_code == 200 and head.content == b""
