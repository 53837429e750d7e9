"""Chat completions answer -> Responses API answer: the `response` object and the streamed
events (`response.created`, `response.in_progress`, per output item `output_item.added`,
`content_part.added`, `output_text.delta`/`reasoning_text.delta`/`function_call_arguments.delta`,
their `.done`s, `output_item.done`, then `response.completed` or `response.incomplete`;
`error` + `response.failed` on a mid-stream failure). Every event has `type` and
`sequence_number`. Codex builds its history from `output_item.done` items and reads usage from
`response.completed`.

Output items: `reasoning` (its text as `reasoning_text` content, no summary), `message` (one
`output_text` part), `function_call` (a `<namespace>.<name>` tool name is split back into
`namespace` and `name`). finish_reason `length` -> status `incomplete`
(reason `max_output_tokens`).
"""

from __future__ import annotations

import time
from typing import Any

from prefixd.api.usage import Usage
from prefixd.api.values import obj
from prefixd.proxy.translate.base import new_id, sse
from prefixd.proxy.translate.chat import Block, Event, read_completion
from prefixd.proxy.translate.stream import BlockStream

NAMESPACE_SEP = "."
_PREFIX = {"thinking": "rs", "text": "msg", "tool": "fc"}
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def usage(u: Usage | None) -> dict[str, Any] | None:
    if u is None:
        return None
    prompt, completion = u.prompt or 0, u.completion or 0
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": u.cached or 0, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _part(block: Block, full: bool) -> dict[str, Any]:
    text = block.text if full else ""
    if block.kind == "thinking":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": []}


def item(block: Block, item_id: str, full: bool) -> dict[str, Any]:
    """An output item: complete (`full`) or as `output_item.added` announces it."""
    status = "completed" if full else "in_progress"
    if block.kind == "thinking":
        return {"type": "reasoning", "id": item_id, "summary": [],
                "content": [_part(block, full)] if full else [], "status": status}
    if block.kind == "text":
        return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                "content": [_part(block, full)] if full else []}
    block.call_id = block.call_id or new_id("call")
    out = {"type": "function_call", "id": item_id, "call_id": block.call_id,
           "name": block.name, "arguments": block.text if full else "", "status": status}
    namespace, sep, name = block.name.partition(NAMESPACE_SEP)
    if sep and namespace and name:
        out.update(namespace=namespace, name=name)
    return out


# The request's fields a `response` object repeats, and their values when the request leaves
# them out (OpenAI's defaults).
ECHOED: dict[str, Any] = {
    "instructions": None, "metadata": {}, "parallel_tool_calls": True, "tool_choice": "auto",
    "tools": [], "temperature": None, "top_p": None, "max_output_tokens": None,
    "text": {"format": {"type": "text"}}}


def echo(client: dict) -> dict[str, Any]:
    """The fields of the client's request a `response` object repeats, as it sent them."""
    return {k: client[k] if client.get(k) is not None else v for k, v in ECHOED.items()}


def response_object(resp_id: str, created: int, model: str, output: list[dict],
                    finish_reason: str | None, u: Usage | None, status: str | None = None,
                    error: dict | None = None, echoed: dict | None = None) -> dict[str, Any]:
    reason = _INCOMPLETE.get(finish_reason or "")
    status = status or ("incomplete" if reason else "completed")
    return {"id": resp_id, "object": "response", "created_at": created, "status": status,
            "error": error,
            "incomplete_details": {"reason": reason} if status == "incomplete" else None,
            **(echoed if echoed is not None else ECHOED), "model": model, "output": output,
            "usage": usage(u)}


def response(chat: dict, echoed: dict | None = None) -> dict:
    """A non-streamed chat.completion -> a Responses `response` object (`echoed`: the
    request's fields it repeats, `echo`)."""
    done = read_completion(chat)
    output = [item(b, new_id(_PREFIX[b.kind]), full=True) for b in done.blocks]
    resp_id = f"resp_{done.id.removeprefix('chatcmpl-')}" if done.id else new_id("resp")
    return response_object(resp_id, done.created or int(time.time()), done.model, output,
                           done.finish_reason, done.usage, echoed=echoed)


class ResponsesStream(BlockStream):
    def __init__(self, echoed: dict | None = None) -> None:
        super().__init__()
        self._echoed = echoed       # the request's fields its `response` objects repeat
        self._id = new_id("resp")
        self._created = int(time.time())
        self._n = 0                            # sequence_number of the next event
        self._ids: dict[int, str] = {}         # output index -> item id
        self._items: list[dict] = []           # finished items, for the final response

    def _close(self) -> bytes:
        seq = self._seq
        final = response_object(self._id, self._created, seq.model, self._items,
                                 seq.finish_reason, seq.usage or Usage(), echoed=self._echoed)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=final)

    def _fail(self, body: dict) -> bytes:
        err = obj(body.get("error"))
        message = err.get("message") if isinstance(err.get("message"), str) else "upstream error"
        code = err.get("code") if err.get("code") == "context_length_exceeded" else (
            "rate_limit_exceeded" if err.get("type") == "rate_limit_error" else "server_error")
        failed = response_object(self._id, self._created, self._seq.model, self._items, None,
                                 self._seq.usage, status="failed",
                                 error={"code": code, "message": message},
                                 echoed=self._echoed)
        return (self._begin()
                + self._event("error", code=code, message=message, param=err.get("param"))
                + self._event("response.failed", response=failed))

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._n, **fields}
        self._n += 1
        return sse(kind, data)

    def _begin(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        snapshot = response_object(self._id, self._created, self._seq.model, [], None, None,
                                   status="in_progress", echoed=self._echoed)
        return (self._event("response.created", response=snapshot)
                + self._event("response.in_progress", response=snapshot))

    def _render(self, events: list[Event]) -> bytes:
        out = []
        for what, block, text in events:
            if what == "start":
                out.append(self._start(block))
            elif what == "delta":
                out.append(self._delta(block, text))
            else:
                out.append(self._stop(block))
        return b"".join(out)

    def _where(self, block: Block) -> dict[str, Any]:
        where: dict[str, Any] = {"item_id": self._ids[block.index], "output_index": block.index}
        if block.kind != "tool":
            where["content_index"] = 0
        return where

    def _start(self, block: Block) -> bytes:
        self._ids[block.index] = item_id = new_id(_PREFIX[block.kind])
        out = self._event("response.output_item.added", output_index=block.index,
                          item=item(block, item_id, full=False))
        if block.kind != "tool":
            out += self._event("response.content_part.added", **self._where(block),
                               part=_part(block, full=False))
        return out

    def _delta(self, block: Block, text: str) -> bytes:
        where = self._where(block)
        if block.kind == "text":
            return self._event("response.output_text.delta", **where, delta=text, logprobs=[])
        if block.kind == "thinking":
            return self._event("response.reasoning_text.delta", **where, delta=text)
        return self._event("response.function_call_arguments.delta", **where, delta=text)

    def _stop(self, block: Block) -> bytes:
        where = self._where(block)
        if block.kind == "text":
            out = self._event("response.output_text.done", **where, text=block.text, logprobs=[])
        elif block.kind == "thinking":
            out = self._event("response.reasoning_text.done", **where, text=block.text)
        else:
            out = self._event("response.function_call_arguments.done", **where,
                              arguments=block.text)
        if block.kind != "tool":
            out += self._event("response.content_part.done", **where,
                               part=_part(block, full=True))
        done = item(block, self._ids[block.index], full=True)
        self._items.append(done)
        return out + self._event("response.output_item.done", output_index=block.index,
                                 item=done)
