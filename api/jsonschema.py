"""JSON-schema rewrites for structured output, pure (no llguidance): what makes a constrained
answer finish, and what lets a schema be embedded in a bigger one.

- `tighten`: objects that declare `properties` and say nothing about other keys are closed
  (`additionalProperties: false`, as llama.cpp does by default and OpenAI's strict mode by
  definition), and integers and numbers without bounds get at most 16 integer digits
  (llama.cpp's cap) and 10 after the point, so a model cannot wander through keys declared
  nowhere, repeat a key or write a 70-digit number. Every answer the tightened schema
  allows, the schema allows. An object merged with another (a member of an `allOf` of
  several, or of an `anyOf`/`oneOf` beside its parent's own keys) is left open: closing it
  would forbid its partner's keys.
- `embed`: a schema's local `$ref`s rewritten to resolve under `#/$defs/<name>`, so a tool's
  parameters (pydantic's and zod's `$defs`/`definitions`) keep working inside the one schema of
  all calls.
- `without_patterns`: the schema without the `pattern`s `bad` rejects (look-arounds, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# llama.cpp's integers: at most 16 digits (`[1-9][0-9]{0,15}`)
NUMBER_BOUND = 10**16 - 1
# at most 10 digits after the point (llama.cpp: 16; llguidance's multipleOf stops at 1e-10)
FRACTION_STEP = 1e-10

_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "additionalProperties", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_OBJECT_KEYS = ("properties", "required", "additionalProperties", "patternProperties",
                "$ref", "minProperties", "maxProperties")


def _map(node: dict[str, Any], fn: Callable[[dict[str, Any], str, bool], Any]
         ) -> dict[str, Any]:
    """A copy of `node` with each direct subschema `s` replaced by `fn(s, pointer step,
    merged)`; `merged`: `s` is intersected with another schema's keys (a member of an `allOf`
    of several, or of an `allOf`/`anyOf`/`oneOf` beside the parent's own object keywords)."""
    out = dict(node)
    own = any(k in node for k in _OBJECT_KEYS)
    for key, value in node.items():
        if key in _ONE and isinstance(value, dict):
            out[key] = fn(value, key, False)
        elif key in _LIST and isinstance(value, list):
            # pydantic's `{"allOf": [{"$ref": ...}], "description": ...}` merges nothing
            merged = (key in ("allOf", "anyOf", "oneOf") and own) or (
                key == "allOf" and len(value) > 1)
            out[key] = [fn(s, f"{key}/{i}", merged) if isinstance(s, dict) else s
                        for i, s in enumerate(value)]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {k: fn(s, f"{key}/{_escape(k)}", False) if isinstance(s, dict) else s
                        for k, s in value.items()}
    return out


def _merged_refs(node: dict[str, Any]) -> set[str]:
    """The `$ref`s of the schemas merged with another (see `_map`)."""
    found: set[str] = set()

    def visit(sub: dict[str, Any], step: str, merged: bool) -> dict[str, Any]:
        if merged and isinstance(sub.get("$ref"), str):
            found.add(sub["$ref"])
        return _map(sub, visit)

    _map(node, visit)
    return found


def tighten(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` with open objects closed and unbounded numbers bounded."""
    shared = _merged_refs(schema)

    def walk(node: dict[str, Any], pointer: str, merged: bool) -> dict[str, Any]:
        # under `not` or `if` a narrower schema would allow more, not less: left as given
        out = _map(node, lambda s, step, m: s if step in ("not", "if") else
                   walk(s, f"{pointer}/{step}", m))
        if (isinstance(node.get("properties"), dict) and not merged and pointer not in shared
                and not any(k in node for k in (*_OPEN, "allOf", "anyOf", "oneOf", "$ref"))):
            out["additionalProperties"] = False
        _bound(out)
        return out

    return walk(schema, "#", False)


def _bound(node: dict[str, Any]) -> None:
    """At most 16 integer digits for an integer or number without a bound on that side, and
    10 after the point for a number (no exponent: bounded numbers are written plainly)."""
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list) or not {"integer", "number"} & set(kinds) \
            or "enum" in node or "const" in node:
        return
    low = _num(node.get("minimum"), node.get("exclusiveMinimum"))
    high = _num(node.get("maximum"), node.get("exclusiveMaximum"))
    if low is None and (high is None or high > -NUMBER_BOUND) and \
            not isinstance(node.get("exclusiveMinimum"), bool):
        node["minimum"] = -NUMBER_BOUND
    if high is None and (low is None or low < NUMBER_BOUND) and \
            not isinstance(node.get("exclusiveMaximum"), bool):
        node["maximum"] = NUMBER_BOUND
    if "number" in kinds and "multipleOf" not in node:
        node["multipleOf"] = FRACTION_STEP


def _num(*values: Any) -> float | None:
    found = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return found[0] if found else None


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def embed(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """`schema` with each local `$ref` ("#", "#/...") rewritten to point under
    `#/$defs/<name>`, where the embedding schema keeps it, and without its own `$id`."""
    base = f"#/$defs/{_escape(name)}"

    def walk(node: dict[str, Any], step: str = "", merged: bool = False) -> dict[str, Any]:
        out = _map(node, walk)
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = base + ref[1:]
        return out

    # its own base URI would make the rewritten refs point into a document of that name
    return {k: v for k, v in walk(schema).items() if k not in ("$id", "id")}


def without_patterns(schema: dict[str, Any], bad: Callable[[str], bool]) -> dict[str, Any]:
    """A copy of `schema` without the string `pattern`s for which `bad(pattern)` is true."""
    def walk(node: dict[str, Any], step: str = "", merged: bool = False) -> dict[str, Any]:
        out = _map(node, walk)
        if isinstance(node.get("pattern"), str) and bad(node["pattern"]):
            del out["pattern"]
        return out

    return walk(schema)
