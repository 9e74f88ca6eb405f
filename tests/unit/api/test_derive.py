"""api.derive: a model gets every field of its source, keeps the body's order and docs, and
refuses a field its source does not have."""

from __future__ import annotations

import msgspec
import pytest
from pydantic import BaseModel, Field

from api.derive import Num, _merged_order, api_type, derived_from


class Part(msgspec.Struct):
    name: str
    weight: float


class Thing(msgspec.Struct):
    id: str
    parts: list[Part]
    score: float
    note: str | None = None
    tags: list[str] = msgspec.field(default_factory=list)


@derived_from(Part)
class PartModel(BaseModel):
    name: str = Field(description="the part's name")


@derived_from(Thing)
class ThingModel(BaseModel):
    """A thing."""

    score: Num = Field(description="how good")


def test_every_source_field_is_there_in_the_source_order() -> None:
    assert list(ThingModel.model_fields) == ["id", "parts", "score", "note", "tags"]
    assert ThingModel.__doc__ == "A thing." and ThingModel.__name__ == "ThingModel"
    assert ThingModel.model_fields["score"].description == "how good"
    assert not ThingModel.model_fields["note"].is_required()
    assert ThingModel.model_fields["tags"].default_factory is list


def test_floats_become_null_when_not_finite_and_structs_their_models() -> None:
    thing = ThingModel.model_validate(
        {"id": "a", "parts": [{"name": "p", "weight": float("inf")}], "score": float("nan")})
    assert thing.model_dump() == {"id": "a", "parts": [{"name": "p", "weight": None}],
                                  "score": None, "note": None, "tags": []}
    assert api_type(float | None) is Num and api_type(list[Part]) == list[PartModel]
    assert api_type(int | None) == int | None


def test_a_field_the_source_lacks_is_refused() -> None:
    with pytest.raises(TypeError, match=r"declares \['weigth'\]"):
        @derived_from(Part)
        class Typo(BaseModel):
            weigth: float


def test_a_struct_needs_its_model_first() -> None:
    class Other(msgspec.Struct):
        x: int

    with pytest.raises(TypeError, match="no API model derived from Other"):
        api_type(list[Other])


def test_undeclared_fields_follow_their_source_predecessor() -> None:
    assert _merged_order(["c", "a"], ["a", "b", "c", "d"]) == ["c", "d", "a", "b"]
    assert _merged_order([], ["x", "y"]) == ["x", "y"]
    assert _merged_order(["b"], ["a", "b", "c"]) == ["a", "b", "c"]
