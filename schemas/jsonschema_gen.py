"""JSON Schema files for every topic, generated from the msgspec models (never hand-written)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import orjson

from schemas.wire import TOPIC_MODELS


def schema_documents() -> dict[str, bytes]:
    """File name -> pretty JSON Schema document of each topic's model."""
    docs: dict[str, bytes] = {}
    for topic, model in TOPIC_MODELS.items():
        schema = msgspec.json.schema(model)
        schema["$id"] = f"https://flare.invalid/schemas/{topic}.json"
        schema["title"] = topic
        docs[f"{topic}.json"] = (
            orjson.dumps(schema, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
        )
    return docs


def write_schemas(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, doc in schema_documents().items():
        path = folder / name
        path.write_bytes(doc)
        written.append(path)
    return written
