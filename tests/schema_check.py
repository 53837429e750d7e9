"""A small JSON-schema validator for the subset the structured-output tests use (`jsonschema`
is not a dependency): type (one or a list), properties, required, additionalProperties (false
or a schema), items, minItems/maxItems, enum, const, minLength/maxLength,
pattern, minimum/maximum, anyOf, oneOf (at least one branch: the grammar enforces it as
anyOf), allOf, and local `$ref`s (`#/$defs/...`, `#/definitions/...`, `#`). Annotations such
as `format` are not checked. Returns the first violation, or None."""

from __future__ import annotations

import re
from typing import Any

_TYPES: dict[str, Any] = {
    "object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
    "integer": int, "number": (int, float)}


def _is(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES[kind])


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    node: Any = root
    for part in ref.removeprefix("#").split("/")[1:]:
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node  # type: ignore[no-any-return]


def violation(value: Any, schema: dict[str, Any], at: str = "$",
              root: dict[str, Any] | None = None) -> str | None:
    root = schema if root is None else root

    def sub(v: Any, s: Any, where: str) -> str | None:
        return violation(v, s, where, root) if isinstance(s, dict) else None

    if isinstance(schema.get("$ref"), str) and (bad := sub(value, _resolve(root, schema["$ref"]),
                                                          at)) is not None:
        return bad
    for s in schema.get("allOf", []):
        if (bad := sub(value, s, at)) is not None:
            return bad
    for key in ("anyOf", "oneOf"):
        if key in schema and all(sub(value, s, at) for s in schema[key]):
            return f"{at}: matches no {key} branch"
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            return f"{at}: {value!r} is not {kinds}"
    if "const" in schema and value != schema["const"]:
        return f"{at}: {value!r} != {schema['const']!r}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{at}: {value!r} not in {schema['enum']}"
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            return f"{at}: length {len(value)} outside the limits"
        if "pattern" in schema and not re.search(schema["pattern"], value):
            return f"{at}: {value!r} does not match {schema['pattern']!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not (
            schema.get("minimum", value) <= value <= schema.get("maximum", value)):
        return f"{at}: {value} outside the range"
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return f"{at}: {len(value)} items outside the limits"
        for i, item in enumerate(value):
            if (bad := sub(item, schema.get("items", {}), f"{at}[{i}]")) is not None:
                return bad
    if isinstance(value, dict):
        props = schema.get("properties", {})
        missing = [k for k in schema.get("required", []) if k not in value]
        if missing:
            return f"{at}: missing {missing}"
        extra = schema.get("additionalProperties")
        if extra is False and set(value) - set(props):
            return f"{at}: unexpected {sorted(set(value) - set(props))}"
        for k, v in value.items():
            s = props.get(k, extra if isinstance(extra, dict) else None)
            if (bad := sub(v, s, f"{at}.{k}")) is not None:
                return bad
    return None
