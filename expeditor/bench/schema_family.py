"""A seeded family of JSON schemas for structured-output tests and the json bench
workload: objects with required fields and ``additionalProperties: false``, nested
objects, arrays with item bounds, enums, bounded integers and numbers, short strings."""

from __future__ import annotations

import random
from typing import Any

NAMES = ["name", "age", "city", "score", "tags", "active", "size", "color", "items", "owner"]


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "string", "enum", "boolean", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 24)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], 3)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": low,
            "maxItems": low + rng.randint(1, 3),
        }
    return schema(rng, depth + 1)


def schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """One object schema drawn from ``rng``."""
    names = rng.sample(NAMES, rng.randint(1, 4 if depth == 0 else 2))
    return {
        "type": "object",
        "properties": {name: _value(rng, depth) for name in names},
        "required": sorted(rng.sample(names, rng.randint(1, len(names)))),
        "additionalProperties": False,
    }


def schemas(seed: int, count: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [schema(rng) for _ in range(count)]
