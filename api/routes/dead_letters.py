"""/v1/dead-letters: the inputs Flare could not use, with why, for whoever fixes the producer."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from api.deps import StoreDep
from api.models import DeadLetter
from api.problems import responses

router = APIRouter(prefix="/dead-letters", tags=["dead letters"])

# schemas.topics.CONSUMED_TOPICS: every topic a worker reads, and so may dead-letter from
InputTopic = Literal["flare.steps.v1", "flare.steps.v2", "flare.heartbeats.v1",
                     "flare.jobs.v1", "flare.partials.v1", "flare.shardsteps.v1"]


@router.get("", response_model=list[DeadLetter], responses=responses(422, 503))
def list_dead_letters(
    store: StoreDep,
    topic: InputTopic | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[DeadLetter]:
    """Dead letters, by topic and partition, newest offsets first: the reason each input was
    refused and its original bytes (base64)."""
    return [DeadLetter.model_validate(r) for r in store.dead_letters(topic=topic, limit=limit)]
