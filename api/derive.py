"""Response models derived from the shapes they show, so a new field cannot be forgotten.

The incident is `schemas.wire.IncidentV1`; a job step is a row of `job_steps` and a rank score
an aggregate of `rank_steps` (both described by `storage.reader` from `storage.tables`). A
model decorated with `derived_from(source)` gets every field of its source: the class body
declares only what the API shows differently (a description, a default, the order clients
have always seen), and any field it does not declare is added with the source's type, placed
after the field that precedes it in the source. A body field the source lacks is an error at
import, so a renamed source field cannot leave a stale API field behind.

Types are translated for JSON: a float may be NaN or ±inf (a δ during warm-up, an average
over nothing) and JSON has no such numbers, so floats become `Num` (those become null); a
nested msgspec struct becomes the model derived from it.
"""

from __future__ import annotations

import functools
import math
import operator
import types
from collections.abc import Callable, Iterable
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import msgspec
from pydantic import BaseModel, BeforeValidator, Field, create_model
from pydantic.fields import FieldInfo


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


Num = Annotated[float | None, BeforeValidator(_finite)]
Model = TypeVar("Model", bound=BaseModel)
Source = type[msgspec.Struct] | Iterable[tuple[str, Any]]
_FROM_STRUCT: dict[type, type[BaseModel]] = {}  # wire struct -> the model derived from it


def api_type(tp: Any) -> Any:
    """The type an API model gives a source field (see the module docstring)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is float:
        return Num
    if origin is Annotated:
        return api_type(args[0])
    if origin is list:
        return list[api_type(args[0])]  # type: ignore[misc]
    if origin in (Union, types.UnionType):
        if set(args) == {float, type(None)}:
            return Num  # already nullable
        return functools.reduce(operator.or_, [api_type(a) for a in args])
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        if tp not in _FROM_STRUCT:
            raise TypeError(f"no API model derived from {tp.__name__} yet: derive it first")
        return _FROM_STRUCT[tp]
    return tp


def source_fields(source: Source) -> list[tuple[str, Any, Any]]:
    """(name, type, default) of every field of a msgspec struct or of (name, type) pairs;
    the default is `...` for a required field."""
    if isinstance(source, type) and issubclass(source, msgspec.Struct):
        out = []
        for f in msgspec.structs.fields(source):
            if f.default_factory is not msgspec.NODEFAULT:
                default: Any = Field(default_factory=f.default_factory)
            else:
                default = ... if f.required else f.default
            out.append((f.name, f.type, default))
        return out
    return [(name, tp, ...) for name, tp in source]


def _merged_order(declared: list[str], source: list[str]) -> list[str]:
    """The declared fields in their order, each source field not declared placed right after
    the field that precedes it in the source (leading ones first)."""
    order = list(declared)
    prev: str | None = None
    for name in source:
        if name not in order:
            order.insert(order.index(prev) + 1 if prev is not None else 0, name)
        prev = name
    return order


def derived_from(source: Source) -> Callable[[type[Model]], type[Model]]:
    """Class decorator: the model with every field of `source` (see the module docstring)."""

    def derive(cls: type[Model]) -> type[Model]:
        fields = {name: (api_type(tp), default) for name, tp, default in source_fields(source)}
        declared: dict[str, FieldInfo] = dict(cls.model_fields)
        stale = sorted(set(declared) - set(fields))
        if stale:
            raise TypeError(f"{cls.__name__} declares {stale}, which its source does not have")
        definitions: dict[str, Any] = {}
        for name in _merged_order(list(declared), list(fields)):
            info = declared.get(name)
            definitions[name] = (info.annotation, info) if info is not None else fields[name]
        model = create_model(cls.__name__, __config__=cls.model_config, __doc__=cls.__doc__,
                             __module__=cls.__module__, **definitions)
        model.__qualname__ = cls.__qualname__
        if isinstance(source, type):
            _FROM_STRUCT[source] = model
        return model  # type: ignore[return-value]

    return derive
