"""api.models: the response models carry every field of the shapes they show."""

from __future__ import annotations

from typing import get_args, get_type_hints

import msgspec

from api.models import Incident, IncidentStatus, RankScore, StepPoint, Suspect
from schemas.wire import IncidentV1
from schemas.wire import Suspect as WireSuspect
from storage.reader import RANK_SCORE_FIELDS, STEP_FIELDS
from storage.testing import make_incident


def test_incident_is_incident_v1_field_for_field() -> None:
    assert list(Incident.model_fields) == list(IncidentV1.__struct_fields__)
    assert list(Suspect.model_fields) == list(WireSuspect.__struct_fields__)
    inc = make_incident("j", status="resolved", resolved_step=30)
    assert Incident.model_validate(msgspec.to_builtins(inc)).model_dump() == \
        msgspec.to_builtins(inc)


def test_status_filter_takes_the_wire_statuses() -> None:
    assert get_args(IncidentStatus) == get_args(get_type_hints(IncidentV1)["status"])


def test_step_points_and_rank_scores_show_what_the_reader_returns() -> None:
    assert set(StepPoint.model_fields) == {name for name, _type in STEP_FIELDS}
    assert set(RankScore.model_fields) == {name for name, _type in RANK_SCORE_FIELDS}


def test_non_finite_numbers_become_null() -> None:
    body = msgspec.to_builtins(make_incident("j"))
    body["slowdown"] = float("nan")
    body["suspects"][0]["confidence"] = float("-inf")
    model = Incident.model_validate(body)
    assert model.model_dump()["slowdown"] is None
    assert model.model_dump()["suspects"][0]["confidence"] is None
