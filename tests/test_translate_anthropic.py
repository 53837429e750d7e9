"""Anthropic Messages API <-> chat completions: requests, answers, streams and errors, checked
against the anthropic SDK's own models and stream accumulator, and real Claude Code requests."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic._streaming import SSEDecoder
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from chat_chunks import ARGS_A, ARGS_B, STREAMS, client_request, completion, tool_call
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from prefixd.proxy.translate import (
    AnthropicTranslator,
    ResponsesTranslator,
    TranslateError,
    count_tokens_request,
)

T = AnthropicTranslator()
EVENT = TypeAdapter(RawMessageStreamEvent)


def body(*messages: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": list(messages), **extra}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def text(t: str, **extra: Any) -> dict[str, Any]:
    return {"type": "text", "text": t, **extra}


IMG = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
IMG_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}
TOOL = {"name": "Bash", "description": "run", "input_schema": {"type": "object"},
        "cache_control": {"type": "ephemeral"}}
FN = {"type": "function", "function": {"name": "Bash", "description": "run",
                                       "parameters": {"type": "object"}}}
USE = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls", "n": "é"}}
CALL = tool_call("toolu_1", "Bash", '{"command": "ls", "n": "é"}')

REQUESTS = [
    ("string content", body(user("hi")),
     {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}),
    ("system blocks joined, cache_control dropped",
     body(user("hi"), system=[text("a"), text("b", cache_control={"type": "ephemeral"})]),
     {"model": "m", "max_tokens": 64, "messages": [{"role": "system", "content": "a\nb"},
                                                   {"role": "user", "content": "hi"}]}),
    ("text blocks joined, image keeps parts",
     body(user([text("a"), text("b")]), {"role": "assistant", "content": "ok"},
          user([text("see"), IMG])),
     {"model": "m", "max_tokens": 64, "messages": [
         {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "ok"},
         {"role": "user", "content": [{"type": "text", "text": "see"}, IMG_PART]}]}),
    ("tool_use, tool_result first then text, error marker",
     body(user("go"), {"role": "assistant", "content": [text("Running."), USE]},
          user([text("also this"), {"type": "tool_result", "tool_use_id": "toolu_1",
                                    "content": [text("out1"), text("out2")], "is_error": True}])),
     {"model": "m", "max_tokens": 64, "messages": [
         {"role": "user", "content": "go"},
         {"role": "assistant", "content": "Running.", "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: out1\nout2"},
         {"role": "user", "content": "also this"}]}),
    ("tool_result image goes to a user message after the tool message",
     body(user([{"type": "tool_result", "tool_use_id": "t", "content": [text("pic"), IMG]}])),
     {"model": "m", "max_tokens": 64, "messages": [
         {"role": "tool", "tool_call_id": "t", "content": "pic"},
         {"role": "user", "content": [IMG_PART]}]}),
    ("thinking -> reasoning_content, redacted dropped, only tool calls -> content null",
     body(user("q"), {"role": "assistant", "content": [
         {"type": "thinking", "thinking": "hmm", "signature": "sig"},
         {"type": "redacted_thinking", "data": "xx"}, USE]}),
     {"model": "m", "max_tokens": 64, "messages": [
         {"role": "user", "content": "q"},
         {"role": "assistant", "content": None, "reasoning_content": "hmm",
          "tool_calls": [CALL]}]}),
    ("mid-conversation system message stays in place",
     body(user("q"), {"role": "system", "content": [text("agents")]}),
     {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "q"},
                                                   {"role": "system", "content": "agents"}]}),
    ("options", body(user("q"), stream=True, stop_sequences=["END"], temperature=0.2, top_p=0.9,
                     top_k=20, metadata={"user_id": "u1"}, thinking={"type": "enabled",
                                                                     "budget_tokens": 1024},
                     tools=[TOOL, {"type": "web_search_20250305", "name": "web_search"}],
                     tool_choice={"type": "any", "disable_parallel_tool_use": True},
                     context_management={"edits": []}, output_config={"effort": "high"}),
     {"model": "m", "stream": True, "stream_options": {"include_usage": True},
      "messages": [{"role": "user", "content": "q"}], "max_tokens": 64, "stop": ["END"],
      "temperature": 0.2, "top_p": 0.9, "top_k": 20, "user": "u1", "tools": [FN],
      "tool_choice": "required", "parallel_tool_calls": False,
      "chat_template_kwargs": {"enable_thinking": True}}),
    ("tool choice by name, thinking disabled, stream false",
     body(user("q"), stream=False, tools=[TOOL], tool_choice={"type": "tool", "name": "Bash"},
          thinking={"type": "disabled"}),
     {"model": "m", "stream": False, "max_tokens": 64, "messages": [{"role": "user",
                                                                      "content": "q"}],
      "tools": [FN], "tool_choice": {"type": "function", "function": {"name": "Bash"}},
      "chat_template_kwargs": {"enable_thinking": False}}),
]


@pytest.mark.parametrize(("name", "given_", "want"), REQUESTS, ids=[r[0] for r in REQUESTS])
def test_request(name: str, given_: dict, want: dict) -> None:
    assert T.request(given_) == want


BAD = [
    ([], None),
    ({"max_tokens": 5}, "messages"),
    ({"messages": [user("hi")]}, "max_tokens"),
    (body(user("hi"), max_tokens=0), "max_tokens"),
    (body({"role": "tool", "content": "x"}), "messages.0.role"),
    (body(user(5)), "messages.0.content"),
    (body(user("a"), {"role": "assistant", "content": "b"},
          user([text("c"), {"type": "audio"}])), "messages.2.content.1.type"),
    (body(user([{"type": "text", "text": 3}])), "messages.0.content.0.text"),
    (body(user("a"), {"role": "assistant", "content": [dict(USE, input="ls")]}),
     "messages.1.content.0.input"),
    (body(user([{"type": "tool_result", "content": "x"}])), "messages.0.content.0.tool_use_id"),
    (body(user([{"type": "image", "source": {"type": "file"}}])), "messages.0.content.0.source"),
    (body(user("a"), system=[IMG]), "system.0.type"),
    (body(user("a"), tools=[{"name": "x"}]), "tools.0.input_schema"),
    (body(user("a"), tool_choice={"type": "maybe"}), "tool_choice.type"),
    (body(user("a"), thinking={"type": "sometimes"}), "thinking.type"),
    (body(user("a"), temperature="hot"), "temperature"),
    (body(user("a"), top_k=1.5), "top_k"),
    (body(user("a"), stream="yes"), "stream"),
    (body(user("a"), stop_sequences=[1]), "stop_sequences"),
    (body(user("a"), metadata={"user_id": 7}), "metadata.user_id"),
]


@pytest.mark.parametrize(("given_", "param"), BAD)
def test_bad_request_names_the_param(given_: Any, param: str | None) -> None:
    with pytest.raises(TranslateError) as e:
        T.request(given_)
    assert e.value.param == param
    assert e.value.message


def test_count_tokens_needs_no_max_tokens_and_never_streams() -> None:
    chat = count_tokens_request({"model": "m", "stream": True, "messages": [user("hi")],
                                 "system": "s", "tools": [TOOL]})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "s"},
                                               {"role": "user", "content": "hi"}],
                    "tools": [FN]}


def test_tool_arguments_rerender_byte_identically() -> None:
    """A tool call the model wrote comes back as `input`; its re-render must match (and what a
    Hugging Face template's `tojson` would print)."""
    args = '{"path": "naïve.py", "lines": [1, 2], "opts": {"a": true, "b": null}}'
    chat = T.request(body(user("q"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "Read", "input": json.loads(args)}]}))
    assert chat["messages"][1]["tool_calls"][0]["function"]["arguments"] == args


RESPONSES = [
    ("text", completion({"content": "Hello"}, cached=40),
     [{"type": "text", "text": "Hello"}], "end_turn",
     {"input_tokens": 60, "output_tokens": 9, "cache_read_input_tokens": 40,
      "cache_creation_input_tokens": 0}),
    ("thinking, text, tools", completion({"reasoning_content": "hm", "content": "Go.",
                                          "tool_calls": [tool_call("c1", "Bash", ARGS_A),
                                                         tool_call("c2", "Read", ARGS_B)]},
                                         finish="tool_calls"),
     [{"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "Go."},
      {"type": "tool_use", "id": "c1", "name": "Bash", "input": json.loads(ARGS_A)},
      {"type": "tool_use", "id": "c2", "name": "Read", "input": json.loads(ARGS_B)}],
     "tool_use", None),
    ("length", completion({"content": "abc"}, finish="length"),
     [{"type": "text", "text": "abc"}], "max_tokens", None),
    ("stop sequence (vLLM stop_reason)", completion({"content": "abc"}, stop_reason="END"),
     [{"type": "text", "text": "abc"}], "stop_sequence", None),
    ("broken tool arguments", completion({"tool_calls": [tool_call("c1", "Bash", '{"comm')]}),
     [{"type": "tool_use", "id": "c1", "name": "Bash", "input": {}}], "tool_use", None),
    ("not a completion", {"error": "boom"}, [], "end_turn", None),
]


@pytest.mark.parametrize(("name", "chat", "content", "stop", "usage"), RESPONSES,
                         ids=[r[0] for r in RESPONSES])
def test_response(name: str, chat: dict, content: list, stop: str, usage: dict | None) -> None:
    msg = T.response(chat)
    Message.model_validate(msg)
    assert msg["content"] == content
    assert msg["stop_reason"] == stop
    assert msg["stop_sequence"] == ("END" if stop == "stop_sequence" else None)
    if usage:
        assert msg["usage"] == usage


def events(data: bytes) -> list[tuple[str, dict]]:
    """Decode SSE bytes with the SDK's decoder; every event must validate."""
    out = []
    for sse in SSEDecoder().iter_bytes(iter([data])):
        payload = sse.json()
        assert payload["type"] == sse.event
        if sse.event not in ("ping", "error"):
            EVENT.validate_python(payload)
        out.append((sse.event, payload))
    return out


def run(chunks: list[Any]) -> tuple[list[tuple[str, dict]], Message]:
    stream = T.stream()
    data = b"".join(stream.feed(c) for c in chunks) + stream.finish()
    assert stream.finish() == b"" and stream.feed(chunks[0] if chunks else {}) == b""
    evs = events(data)
    snapshot, json_bufs = None, {}
    for name, payload in evs:
        if name != "ping":
            snapshot = accumulate_event(event=payload, current_snapshot=snapshot,
                                        json_bufs=json_bufs)
    return evs, Message.model_validate(snapshot.to_dict())


def summary(evs: list[tuple[str, dict]]) -> list[str]:
    out = []
    for name, p in evs:
        if name == "content_block_start":
            out.append(f"start {p['index']} {p['content_block']['type']}")
        elif name == "content_block_delta":
            value = next(v for k, v in p["delta"].items() if k != "type")
            out.append(f"delta {p['index']} {value}")
        elif name == "content_block_stop":
            out.append(f"stop {p['index']}")
        elif name == "message_delta":
            out.append(f"message_delta {p['delta']['stop_reason']}")
        else:
            out.append(name)
    return out


HEAD, TAIL = ["message_start", "ping"], ["message_stop"]
STREAM_CASES = [
    ("text", ["start 0 text", "delta 0 Hel", "delta 0 lo", "stop 0", "message_delta end_turn"],
     [{"type": "text", "text": "Hello"}]),
    ("tool_split", ["start 0 tool_use", *[f"delta 0 {ARGS_A[i:i + 4]}"
                                          for i in range(0, len(ARGS_A), 4)],
                    "stop 0", "message_delta tool_use"],
     [{"type": "tool_use", "id": "call_1", "name": "Bash", "input": json.loads(ARGS_A)}]),
    ("parallel_interleaved", ["start 0 tool_use", *[f"delta 0 {ARGS_A[i:i + 8]}"
                                                    for i in range(0, len(ARGS_A), 8)],
                              "stop 0", "start 1 tool_use", f"delta 1 {ARGS_B}", "stop 1",
                              "message_delta tool_use"],
     [{"type": "tool_use", "id": "call_a", "name": "Bash", "input": json.loads(ARGS_A)},
      {"type": "tool_use", "id": "call_b", "name": "Read", "input": json.loads(ARGS_B)}]),
    ("reasoning_text_tool", ["start 0 thinking", "delta 0 Let me ", "delta 0 look.", "stop 0",
                             "start 1 text", "delta 1 Listing.", "stop 1", "start 2 tool_use",
                             f"delta 2 {ARGS_A}", "stop 2", "message_delta tool_use"],
     [{"type": "thinking", "thinking": "Let me look.", "signature": ""},
      {"type": "text", "text": "Listing."},
      {"type": "tool_use", "id": "call_1", "name": "Bash", "input": json.loads(ARGS_A)}]),
    ("reasoning_key", ["start 0 thinking", "delta 0 hm", "stop 0", "start 1 text", "delta 1 ok",
                       "stop 1", "message_delta end_turn"],
     [{"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "ok"}]),
    ("malformed", ["start 0 text", "delta 0 fine", "stop 0", "message_delta end_turn"],
     [{"type": "text", "text": "fine"}]),
    ("length", ["start 0 text", "delta 0 abc", "stop 0", "message_delta max_tokens"],
     [{"type": "text", "text": "abc"}]),
    ("empty", ["message_delta end_turn"], []),
]


@pytest.mark.parametrize(("case", "want", "content"), STREAM_CASES,
                         ids=[c[0] for c in STREAM_CASES])
def test_stream(case: str, want: list[str], content: list[dict]) -> None:
    evs, message = run(STREAMS[case])
    assert summary(evs) == HEAD + want + TAIL
    assert message.model_dump(exclude_none=True)["content"] == content
    assert message.stop_reason == want[-1].split()[-1]


def test_stream_usage_excludes_cached_tokens_from_input() -> None:
    evs, _ = run(STREAMS["text"])
    start = evs[0][1]["message"]
    assert start["usage"]["input_tokens"] == 0 and start["model"] == "qwen3"
    delta = next(p for name, p in evs if name == "message_delta")
    assert delta["usage"] == {"input_tokens": 24, "output_tokens": 2,
                              "cache_read_input_tokens": 96, "cache_creation_input_tokens": 0}


def test_stream_error_ends_the_stream() -> None:
    stream = T.stream()
    first = stream.feed(STREAMS["text"][1])
    body = T.error_body(502, "upstream_error", "backend llama unreachable", None, None)
    data = stream.error(body)
    assert data.startswith(b"event: error\n")
    assert stream.feed(STREAMS["text"][2]) == b"" and stream.finish() == b""
    ((_, payload),) = events(data)
    ErrorResponse.model_validate(payload)
    assert payload["error"] == {"type": "api_error", "message": "backend llama unreachable"}
    assert events(first)[0][0] == "message_start"


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "invalid_request_error"), (429, "rate_limit_error"), (500, "api_error"),
    (502, "api_error"), (503, "overloaded_error"), (504, "timeout_error")])
def test_error_body(status: int, kind: str) -> None:
    err = T.error_body(status, "whatever", "msg", "messages.0", "code")
    ErrorResponse.model_validate(err)
    assert err == {"type": "error", "error": {"type": kind, "message": "msg"}}


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["choices", "delta", "index", "content",
                                                       "tool_calls", "function", "name", "id",
                                                       "arguments", "usage", "finish_reason",
                                                       "reasoning_content", "model"]),
                                      inner, max_size=4), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(st.lists(JSON, max_size=6))
def test_feed_never_raises(chunks: list[Any]) -> None:
    for translator in (AnthropicTranslator, ResponsesTranslator):
        stream = translator().stream()
        for c in chunks:
            assert isinstance(stream.feed(c), bytes)
        assert isinstance(stream.finish(), bytes)


CLAUDE = ["claude-code-2.1.197-turn1.json", "claude-code-2.1.197-turn2-tool-result.json",
          "claude-code-2.1.197-no-thinking-no-attribution.json",
          "claude-code-2.1.197-turn2-after-prefixd-stream.json"]


@pytest.mark.parametrize("name", CLAUDE)
def test_real_claude_code_requests(name: str) -> None:
    captured = client_request(name)
    assert captured["path"] == T.path
    chat = T.request(captured["body"])
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["messages"][0]["role"] == "system"
    assert [m["role"] for m in chat["messages"][1:3]] == ["user", "system"]
    assert len(chat["tools"]) == len(captured["body"]["tools"])
    assert "cache_control" not in json.dumps(chat)


def test_claude_code_tool_turn_round_trips() -> None:
    """Turn 2 after prefixd streamed thinking + text + a tool call: Claude Code sends them back
    and they render as one assistant message with the arguments the model wrote."""
    chat = T.request(client_request(CLAUDE[3])["body"])
    assistant, tool = chat["messages"][3:5]
    assert assistant == {"role": "assistant", "content": "Running it.",
                         "reasoning_content": "Let me think.",
                         "tool_calls": [tool_call("call_x1", "Bash",
                                                  '{"command": "echo hi", "description": '
                                                  '"say hi"}')]}
    assert tool == {"role": "tool", "tool_call_id": "call_x1", "content": "hi"}
