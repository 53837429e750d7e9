"""A small JSON-schema validator for the subset the structured-output tests use (`jsonschema`
is not a dependency): type (one or a list), properties, required, additionalProperties false,
items, minItems/maxItems, enum, const, minLength/maxLength, minimum/maximum, anyOf. Returns
the first violation, or None."""

from __future__ import annotations

from typing import Any

_TYPES: dict[str, Any] = {
    "object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
    "integer": int, "number": (int, float)}


def _is(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[kind])


def violation(value: Any, schema: dict[str, Any], at: str = "$") -> str | None:
    if "anyOf" in schema and all(violation(value, s, at) for s in schema["anyOf"]):
        return f"{at}: matches no anyOf branch"
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            return f"{at}: {value!r} is not {kinds}"
    if "const" in schema and value != schema["const"]:
        return f"{at}: {value!r} != {schema['const']!r}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{at}: {value!r} not in {schema['enum']}"
    if isinstance(value, str) and not (schema.get("minLength", 0) <= len(value)
                                       <= schema.get("maxLength", len(value))):
        return f"{at}: length {len(value)} outside the limits"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not (
            schema.get("minimum", value) <= value <= schema.get("maximum", value)):
        return f"{at}: {value} outside the range"
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return f"{at}: {len(value)} items outside the limits"
        for i, item in enumerate(value):
            if (bad := violation(item, schema.get("items", {}), f"{at}[{i}]")) is not None:
                return bad
    if isinstance(value, dict):
        props = schema.get("properties", {})
        missing = [k for k in schema.get("required", []) if k not in value]
        if missing:
            return f"{at}: missing {missing}"
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return f"{at}: unexpected {sorted(set(value) - set(props))}"
        for k, v in value.items():
            if k in props and (bad := violation(v, props[k], f"{at}.{k}")) is not None:
                return bad
    return None
