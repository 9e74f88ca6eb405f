"""api.routes.jobs over the in-memory store: jobs with their health, step series and their
pages, per-rank scores, and the problems for unknown jobs and bad parameters."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from storage.testing import SAMPLE_JOB as JOB
from storage.testing import MemoryStore

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_jobs_with_their_health(client: TestClient, problem) -> None:
    jobs = {j["job"]: j for j in client.get("/v1/jobs").json()["items"]}
    assert list(jobs) == ["many", "quiet", JOB]  # by name
    assert jobs[JOB]["health"] == "incident" and jobs[JOB]["open_incidents"] == 1
    assert jobs[JOB]["incidents"] == 2 and jobs[JOB]["last_step"] == 59
    assert jobs[JOB]["step_time_s"] == 1.2 and jobs[JOB]["delta"] == 1.2
    assert jobs["quiet"]["health"] == "irregular" and jobs["quiet"]["irregular"] == "spike"
    assert jobs["many"]["health"] == "ok" and jobs["many"]["incidents"] == 7
    assert client.get(f"/v1/jobs/{JOB}").json() == jobs[JOB]
    page = client.get("/v1/jobs", params={"limit": 1, "offset": 1}).json()
    assert [j["job"] for j in page["items"]] == ["quiet"] and page["offset"] == 1
    problem(client.get("/v1/jobs/nope"), 404)


def test_step_series_pages_forward_and_shows_the_newest_by_default(
    client: TestClient, problem
) -> None:
    url = f"/v1/jobs/{JOB}/steps"
    newest = client.get(url, params={"limit": 5}).json()
    assert [s["step"] for s in newest["steps"]] == [55, 56, 57, 58, 59]
    assert newest["next_from_step"] is None and newest["job"] == JOB
    assert list(newest["steps"][0]) == ["step", "ts_ns", "step_time_s", "baseline_s", "delta",
                                        "irregular", "level_shift", "n_ranks", "n_missing",
                                        "n_detections"]
    page = client.get(url, params={"from_step": 40, "to_step": 49, "limit": 4}).json()
    assert [s["step"] for s in page["steps"]] == [40, 41, 42, 43] and page["next_from_step"] == 44
    last = client.get(url, params={"from_step": 48, "to_step": 49, "limit": 4}).json()
    assert [s["step"] for s in last["steps"]] == [48, 49] and last["next_from_step"] is None
    spikes = client.get(url, params={"irregular": ["spike", "fluctuation"]}).json()["steps"]
    assert [(s["step"], s["irregular"]) for s in spikes] == [(45, "spike")]
    problem(client.get("/v1/jobs/nope/steps"), 404)
    problem(client.get(url, params={"from_step": 9, "to_step": 3}), 422)
    # an unknown class is refused with the valid ones, not answered with nothing
    bogus = problem(client.get(url, params={"irregular": "bogus"}), 422)
    assert "'spike'" in bogus["detail"] and "'persistent'" in bogus["detail"]


def test_rank_scores(client: TestClient, problem) -> None:
    url = f"/v1/jobs/{JOB}/ranks"
    recent = client.get(url, params={"last": 10}).json()
    assert (recent["from_step"], recent["to_step"]) == (50, 59)
    assert [r["rank"] for r in recent["ranks"]] == [0, 1, 2, 3]
    slow = recent["ranks"][1]
    assert slow["steps"] == 10 and slow["compute_ratio"] == 1.5 and slow["node"] == "node-0"
    assert slow["caused_wait_s"] == 0.9 and slow["caused_wait_total_s"] == 9.0
    top = client.get(url, params={"sort": "caused_wait", "limit": 1}).json()["ranks"]
    assert [r["rank"] for r in top] == [1]
    at = client.get(url, params={"step": 5}).json()
    assert (at["from_step"], at["to_step"]) == (5, 5)
    assert all(r["compute_ratio"] == 1.0 for r in at["ranks"])
    assert client.get(url).json()["from_step"] == 0  # default: newest 100 steps, from 0 here
    problem(client.get(url, params={"step": 999}), 404)
    problem(client.get(url, params={"last": 5, "step": 3}), 422)
    problem(client.get(url, params={"sort": "speed"}), 422)
    problem(client.get("/v1/jobs/nope/ranks"), 404)


def test_storage_trouble_is_a_503(store: MemoryStore, client: TestClient, problem) -> None:
    store.fail = True
    for url in ("/v1/jobs", f"/v1/jobs/{JOB}", f"/v1/jobs/{JOB}/steps", f"/v1/jobs/{JOB}/ranks"):
        problem(client.get(url), 503)
