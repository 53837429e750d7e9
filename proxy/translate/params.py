"""Where a field of the translated chat body came from in the client's body, so an error
names the field the client sent, in its API's own terms (`Translator.client_param`). Pure.

- `messages`: Messages `messages`, Responses `input`;
- `response_format.json_schema.schema`: Messages `output_config.format.schema` (or the beta's
  `output_format.schema`), Responses `text.format.schema`;
- `tools[i].function.parameters`: Messages `tools.<k>.input_schema` (server tools are not
  forwarded, so k >= i), Responses `tools[k].parameters` (or a namespace member's
  `tools[k].tools[j].parameters`).
"""

from __future__ import annotations

import re
from typing import Any

from prefixd.api.values import arr

_TOOL = re.compile(r"^tools\[(\d+)\]\.function\.parameters$")
_FORMAT = "response_format"


def _tool_index(param: str) -> int | None:
    m = _TOOL.match(param)
    return int(m.group(1)) if m else None


def anthropic_param(body: dict[str, Any], param: str) -> str:
    """`param` of the chat body as the Messages request's field."""
    if param.startswith(_FORMAT):
        config = body.get("output_config")
        base = "output_config.format" if isinstance(config, dict) and isinstance(
            config.get("format"), dict) else "output_format"
        rest = param[len(_FORMAT):].replace(".json_schema", "")
        return base + rest
    i = _tool_index(param)
    if i is not None:
        kept = [k for k, t in enumerate(arr(body.get("tools")))
                if isinstance(t, dict) and t.get("type") in (None, "custom")]
        return f"tools.{kept[i]}.input_schema" if i < len(kept) else "tools"
    return param


def responses_param(body: dict[str, Any], param: str) -> str:
    """`param` of the chat body as the Responses request's field."""
    if param == "messages":
        return "input"
    if param.startswith(_FORMAT):
        return "text.format" + param[len(_FORMAT):].replace(".json_schema", "")
    i = _tool_index(param)
    if i is not None:
        paths: list[str] = []
        for k, tool in enumerate(arr(body.get("tools"))):
            if not isinstance(tool, dict):
                continue
            if tool.get("type") == "function":
                paths.append(f"tools[{k}].parameters")
            elif tool.get("type") == "namespace":
                paths += [f"tools[{k}].tools[{j}].parameters"
                          for j, m in enumerate(arr(tool.get("tools")))
                          if isinstance(m, dict) and m.get("type") == "function"]
        return paths[i] if i < len(paths) else "tools"
    return param
