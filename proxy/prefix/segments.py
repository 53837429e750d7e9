"""Flatten a request body into segments in render order: model, template parameters, tools,
system, messages (each message: a meta segment for role/name/ids, then reasoning, content
parts, tool calls). Bodies are OpenAI chat or completions bodies: the proxy translates the
other client APIs (Anthropic Messages, Responses) into chat form before the prefix stages
see them. A `/v1/completions` body becomes one `prompt` segment.

Owns: the path names reports show (`system[0]`, `tools[3]`, `messages[52].content[1]`) and
`loc`, the key path of a text inside the body, so rules can write a text back
(`replace_texts`) without mutating the client's dict.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, TypeGuard

# Template-affecting parameters: they change the rendered prompt as surely as the text does.
PARAM_KEYS = ("chat_template_kwargs", "reasoning_effort", "enable_thinking", "tool_choice",
              "thinking", "parallel_tool_calls")
RENDERED = ("tools", "system", "messages")
Loc = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Segment:
    path: str          # as reports show it
    region: str        # model | params | tools | system | messages
    kind: str          # model, params, tool, text, meta, reasoning, tool_call, prompt
    text: str
    role: str = ""
    msg: int | None = None      # index in body["messages"]
    loc: Loc | None = None      # key path of `text` inside the body, for string texts

    @property
    def rendered(self) -> bool:
        return self.region in RENDERED

    def digest(self) -> str:
        return hashlib.sha1(self.text.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def dumps(value: Any) -> str:
    """JSON in the client's key order (json.loads keeps it), the bytes a client would send."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def canonical(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def without_cache_control(value: Any) -> Any:
    """Rule R0: cache_control markers are transport hints, never compared."""
    if isinstance(value, dict):
        return {k: without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [without_cache_control(v) for v in value]
    return value


def tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        fn = tool.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
        if isinstance(tool.get("name"), str):
            return tool["name"]
    return canonical(tool)[:40]


def flatten(body: dict) -> list[Segment]:
    """All segments of `body` in render order."""
    segs = [Segment("model", "model", "model", str(body.get("model", "")))]
    params = {k: body[k] for k in PARAM_KEYS if k in body}
    if params:
        segs.append(Segment("params", "params", "params", canonical(params)))
    if "prompt" in body and "messages" not in body:
        prompt = body["prompt"]
        text = prompt if isinstance(prompt, str) else dumps(prompt)
        segs.append(Segment("prompt", "messages", "prompt", text,
                            loc=("prompt",) if isinstance(prompt, str) else None))
        return segs
    for i, tool in enumerate(body.get("tools") or []):
        segs.append(Segment(f"tools[{i}]", "tools", "tool", dumps(without_cache_control(tool))))
    messages = body.get("messages") or []
    leading = True
    n_sys = 0
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            segs.append(Segment(f"messages[{k}]", "messages", "meta", dumps(m), msg=k))
            continue
        role = str(m.get("role", ""))
        if leading and role in ("system", "developer"):
            segs.extend(_message(m, k, f"system[{n_sys}]", "system"))
            n_sys += 1
            continue
        leading = False
        segs.extend(_message(m, k, f"messages[{k}]", "messages"))
    return segs


def system_segments(body: dict) -> list[Segment]:
    """Only the system segments of `body` (what the system rules need), cheaply."""
    if "prompt" in body and "messages" not in body:
        return []
    segs: list[Segment] = []
    messages = body.get("messages")
    for k, m in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer"):
            break
        segs.extend(_message(m, k, f"system[{k}]", "system"))
    return segs


def _message(m: dict, k: int, path: str, region: str) -> list[Segment]:
    role = str(m.get("role", ""))
    meta = f"{role}|{m.get('name', '')}|{m.get('tool_call_id', '')}"
    segs = [Segment(path, region, "meta", meta, role, k)]
    for key in ("reasoning_content", "reasoning", "thinking"):
        if isinstance(m.get(key), str) and m[key]:
            segs.append(Segment(f"{path}.{key}", region, "reasoning", m[key], role, k,
                                ("messages", k, key)))
    content = m.get("content")
    if isinstance(content, str):
        segs.append(Segment(path, region, "text", content, role, k, ("messages", k, "content")))
    elif _single_text(content):
        # one text part renders like the plain string (clients flip between the two, e.g. to
        # move a cache_control marker): the same segment either way, so no false alarm
        segs.append(Segment(path, region, "text", content[0]["text"], role, k,
                            ("messages", k, "content", 0, "text")))
    elif isinstance(content, list):
        for p, part in enumerate(content):
            segs.append(_part(part, f"{path}.content[{p}]", region, role, k,
                              ("messages", k, "content", p)))
    elif content is not None:
        segs.append(Segment(f"{path}.content", region, "text", dumps(content), role, k))
    for t, call in enumerate(m.get("tool_calls") or []):
        segs.append(Segment(f"{path}.tool_calls[{t}]", region, "tool_call",
                            dumps(_call_without_id(call)), role, k))
    return segs


def _single_text(content: Any) -> TypeGuard[list[dict[str, Any]]]:
    return (isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict)
            and content[0].get("type") == "text" and isinstance(content[0].get("text"), str))


def _part(part: Any, path: str, region: str, role: str, k: int, loc: Loc) -> Segment:
    """A content part: its text, or an image or other part as its JSON."""
    if not isinstance(part, dict):
        return Segment(path, region, "text", dumps(part), role, k)
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
        return Segment(path, region, "text", part["text"], role, k, (*loc, "text"))
    return Segment(path, region, "text", dumps(without_cache_control(part)), role, k)


def _call_without_id(call: Any) -> Any:
    # Call ids are minted per response by the server; templates rarely render them.
    if isinstance(call, dict):
        return {k: v for k, v in call.items() if k not in ("id", "index")}
    return call


def rendered_chars(segs: list[Segment]) -> int:
    return sum(len(s.text) for s in segs if s.rendered)


def replace_texts(body: dict, edits: dict[Loc, str]) -> dict:
    """A copy of `body` with the string at each loc replaced; containers on the way are
    copied, everything else is shared (the client's dict is never mutated)."""
    out = dict(body)
    for loc, text in edits.items():
        node: Any = out
        for key in loc[:-1]:
            child = node[key]
            child = dict(child) if isinstance(child, dict) else list(child)
            node[key] = child
            node = child
        node[loc[-1]] = text
    return out


def collapse_ws(value: Any) -> Any:
    """The value with every string's whitespace collapsed (whitespace-only comparisons)."""
    if isinstance(value, str):
        return " ".join(value.split())
    if isinstance(value, dict):
        return {k: collapse_ws(v) for k, v in value.items()}
    if isinstance(value, list):
        return [collapse_ws(v) for v in value]
    return value
