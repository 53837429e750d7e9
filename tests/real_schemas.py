"""Real-world-style JSON schemas for the structured-output tests, as the tools that write
them emit them: pydantic v2 (`$defs`, `$ref`, `allOf` around a described `$ref`, `anyOf` with
null for Optional, `title`s, no `additionalProperties`), zod-to-json-schema (draft-07
`definitions`, `$schema`), a Kubernetes-ish object (maps, `format: int32`, `x-kubernetes-*`
annotations), an OpenAI function-calling tool, and schemastore/GitHub-style files with the
keywords a grammar cannot enforce (`uniqueItems`, `if`/`then`, `dependencies`, overlapping
`oneOf`, annotation `format`s)."""

from __future__ import annotations

from typing import Any

PYDANTIC_ORDER: dict[str, Any] = {
    "$defs": {
        "Address": {"properties": {
            "street": {"title": "Street", "type": "string"},
            "city": {"title": "City", "type": "string"},
            "zip_code": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None,
                         "title": "Zip Code"}},
            "required": ["street", "city"], "title": "Address", "type": "object"},
        "Item": {"properties": {
            "sku": {"title": "Sku", "type": "string"},
            "quantity": {"title": "Quantity", "type": "integer"},
            "price": {"title": "Price", "type": "number"}},
            "required": ["sku", "quantity", "price"], "title": "Item", "type": "object"},
        "Status": {"enum": ["pending", "shipped", "delivered"], "title": "Status",
                   "type": "string"}},
    "properties": {
        "order_id": {"title": "Order Id", "type": "integer"},
        "customer": {"title": "Customer", "type": "string"},
        "shipping": {"allOf": [{"$ref": "#/$defs/Address"}],
                     "description": "Where the order goes"},
        "items": {"items": {"$ref": "#/$defs/Item"}, "title": "Items", "type": "array",
                  "maxItems": 2},
        "status": {"$ref": "#/$defs/Status"}},
    "required": ["order_id", "customer", "shipping", "items", "status"],
    "title": "Order", "type": "object"}

ZOD_EVENT: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "definitions": {"person": {"type": "object", "properties": {
        "name": {"type": "string"}, "email": {"type": "string", "format": "email",
                                              "maxLength": 24}},
        "required": ["name"], "additionalProperties": False}},
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "attendees": {"type": "array", "items": {"$ref": "#/definitions/person"},
                      "maxItems": 2},
        "priority": {"type": "number", "minimum": 0, "maximum": 10}},
    "required": ["title", "attendees", "priority"], "additionalProperties": False}

KUBE_DEPLOYMENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "apiVersion": {"type": "string", "enum": ["apps/v1"]},
        "kind": {"type": "string", "enum": ["Deployment"]},
        "metadata": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30},
            "labels": {"type": "object", "additionalProperties": {"type": "string"},
                       "maxProperties": 2}},
            "required": ["name"]},
        "spec": {"type": "object", "properties": {
            "replicas": {"type": "integer", "format": "int32"},
            "template": {"type": "object", "properties": {
                "spec": {"type": "object", "properties": {
                    "containers": {"type": "array", "maxItems": 1, "items": {
                        "type": "object", "properties": {
                            "name": {"type": "string"}, "image": {"type": "string"},
                            "ports": {"type": "array", "maxItems": 1, "items": {
                                "type": "object", "properties": {
                                    "containerPort": {"type": "integer", "format": "int32"}},
                                "required": ["containerPort"]},
                                "x-kubernetes-list-type": "map"}},
                        "required": ["name", "image"]}}},
                    "required": ["containers"]}},
                "required": ["spec"]}},
            "required": ["replicas", "template"],
            "x-kubernetes-preserve-unknown-fields": False}},
    "required": ["apiVersion", "kind", "metadata", "spec"]}

# an OpenAI function tool's parameters, as the SDK's pydantic helper writes them
WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"location": {"type": "string", "description": "City and country"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer"}},
    "required": ["location", "unit", "days"]}

# keywords llguidance cannot enforce (each was a 400 before): ignored, as llama.cpp does
UNENFORCEABLE: dict[str, dict[str, Any]] = {
    "format_color": {"type": "object", "properties": {
        "background": {"type": "string", "format": "color"},
        "link": {"type": "string", "format": "uri-reference"}},
        "required": ["background", "link"]},
    "unique_items": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                 "uniqueItems": True, "maxItems": 3}}, "required": ["tags"]},
    "if_then": {"type": "object", "properties": {
        "kind": {"enum": ["a", "b"]}, "size": {"type": "integer"}},
        "required": ["kind", "size"],
        "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["size"]}},
    "dependencies": {"type": "object", "properties": {
        "card": {"type": "string", "maxLength": 8}, "billing": {"type": "string",
                                                               "maxLength": 8}},
        "required": ["card", "billing"], "dependencies": {"card": ["billing"]}},
    "overlapping_one_of": {"type": "object", "properties": {
        "ref": {"oneOf": [{"type": "string", "maxLength": 8},
                          {"type": "string", "pattern": "^v[0-9]$"}]}},
        "required": ["ref"]},
}
