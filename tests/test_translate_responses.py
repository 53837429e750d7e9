"""OpenAI Responses API <-> chat completions: requests, answers, streams and errors, checked
against the openai SDK's own models, and real Codex CLI requests."""

from __future__ import annotations

import json
from typing import Any

import pytest
from chat_chunks import ARGS_A, ARGS_B, STREAMS, client_request, completion, tool_call
from openai._streaming import SSEDecoder
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from prefixd.proxy.translate import TranslateError
from prefixd.proxy.translate.responses import ResponsesTranslator

T = ResponsesTranslator()
EVENT = TypeAdapter(ResponseStreamEvent)
SYS = {"role": "system", "content": "be brief"}


def msg(role: str, content: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content, **extra}


def fcall(call_id: str, name: str, args: str, **extra: Any) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": args,
            **extra}


def out(call_id: str, output: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


REASONING = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text",
                                                             "text": "s"}],
             "content": [{"type": "reasoning_text", "text": "think"}], "encrypted_content": None}
FN = {"type": "function", "name": "exec_command", "description": "run", "strict": False,
      "parameters": {"type": "object"}}
CHAT_FN = {"type": "function", "function": {"name": "exec_command", "description": "run",
                                            "parameters": {"type": "object"}, "strict": False}}

REQUESTS = [
    ("string input", {"model": "m", "input": "hi", "instructions": "be brief"},
     {"model": "m", "messages": [SYS, {"role": "user", "content": "hi"}]}),
    ("message items, developer -> system, parts joined",
     {"input": [msg("developer", [{"type": "input_text", "text": "rules"}]),
                msg("user", [{"type": "input_text", "text": "a"},
                             {"type": "input_text", "text": "b"}], id="msg_x"),
                {"role": "assistant", "content": "ok"},
                msg("user", [{"type": "input_text", "text": "see"},
                             {"type": "input_image", "image_url": "data:image/png;base64,i"}])]},
     {"messages": [{"role": "system", "content": "rules"}, {"role": "user", "content": "a\nb"},
                   {"role": "assistant", "content": "ok"},
                   {"role": "user", "content": [
                       {"type": "text", "text": "see"},
                       {"type": "image_url", "image_url": {"url": "data:image/png;base64,i"}}]}]}),
    ("a turn: reasoning, text, two calls, outputs",
     {"input": [msg("user", "go"), REASONING,
                msg("assistant", [{"type": "output_text", "text": "Running.", "annotations": []}]),
                fcall("c1", "exec_command", ARGS_A, id="fc_1", status="completed"),
                fcall("c2", "close_agent", ARGS_B, namespace="multi_agent_v1"),
                out("c1", "done"), out("c2", [{"type": "input_text", "text": "x"}])]},
     {"messages": [{"role": "user", "content": "go"},
                   {"role": "assistant", "content": "Running.", "reasoning_content": "think",
                    "tool_calls": [tool_call("c1", "exec_command", ARGS_A),
                                   tool_call("c2", "multi_agent_v1.close_agent", ARGS_B)]},
                   {"role": "tool", "tool_call_id": "c1", "content": "done"},
                   {"role": "tool", "tool_call_id": "c2", "content": "x"}]}),
    ("calls without text start an assistant message; stray reasoning is dropped",
     {"input": [REASONING, msg("user", "go"), REASONING, fcall("c1", "f", "{}")]},
     {"messages": [{"role": "user", "content": "go"},
                   {"role": "assistant", "content": None, "reasoning_content": "think",
                    "tool_calls": [tool_call("c1", "f", "{}")]}]}),
    ("options", {"input": "q", "stream": True, "max_output_tokens": 256, "temperature": 0.1,
                 "top_p": 0.5, "prompt_cache_key": "sess-1", "parallel_tool_calls": True,
                 "store": True, "include": ["reasoning.encrypted_content"],
                 "reasoning": {"effort": "none", "summary": "auto"},
                 "tools": [FN, {"type": "web_search", "external_web_access": False},
                           {"type": "namespace", "name": "ns", "description": "d",
                            "tools": [dict(FN, name="spawn")]}],
                 "tool_choice": {"type": "function", "name": "exec_command"},
                 "text": {"format": {"type": "json_schema", "name": "out",
                                     "schema": {"type": "object"}, "strict": True}},
                 "client_metadata": {"a": "b"}},
     {"stream": True, "stream_options": {"include_usage": True},
      "messages": [{"role": "user", "content": "q"}], "max_tokens": 256, "temperature": 0.1,
      "top_p": 0.5, "prompt_cache_key": "sess-1", "parallel_tool_calls": True,
      "tools": [CHAT_FN, {"type": "function", "function": dict(CHAT_FN["function"],
                                                               name="ns.spawn")}],
      "tool_choice": {"type": "function", "function": {"name": "exec_command"}},
      "chat_template_kwargs": {"enable_thinking": False},
      "response_format": {"type": "json_schema", "json_schema": {
          "name": "out", "schema": {"type": "object"}, "strict": True}}}),
    ("effort high, tool_choice string", {"input": "q", "reasoning": {"effort": "high"},
                                         "tool_choice": "required"},
     {"messages": [{"role": "user", "content": "q"}], "tool_choice": "required",
      "chat_template_kwargs": {"enable_thinking": True}}),
]


@pytest.mark.parametrize(("name", "given_", "want"), REQUESTS, ids=[r[0] for r in REQUESTS])
def test_request(name: str, given_: dict, want: dict) -> None:
    assert T.request(given_) == want


BAD = [
    ("x", None),
    ({"input": "q", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [msg("tool", "x")]}, "input[0].role"),
    ({"input": [msg("user", [{"type": "input_file", "file_id": "f"}])]},
     "input[0].content[0].type"),
    ({"input": [msg("user", {"text": "x"})]}, "input[0].content"),
    ({"input": [msg("user", "q"), fcall("", "f", "{}")]}, "input[1].call_id"),
    ({"input": [fcall("c", "f", {"a": 1})]}, "input[0].arguments"),
    ({"input": [out("c", [{"type": "input_image", "image_url": "u"}])]}, "input[0].output"),
    ({"input": "q", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "q", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "q", "max_output_tokens": "lots"}, "max_output_tokens"),
    ({"input": "q", "temperature": True}, "temperature"),
    ({"input": "q", "instructions": 3}, "instructions"),
]


@pytest.mark.parametrize(("given_", "param"), BAD)
def test_bad_request_names_the_param(given_: Any, param: str | None) -> None:
    with pytest.raises(TranslateError) as e:
        T.request(given_)
    assert e.value.param == param


def test_response() -> None:
    resp = T.response(completion({"reasoning_content": "hm", "content": "Go.",
                                  "tool_calls": [tool_call("c1", "exec_command", ARGS_A),
                                                 tool_call("c2", "ns.spawn", ARGS_B)]},
                                 finish="tool_calls", cached=30))
    Response.model_validate(resp)
    assert resp["status"] == "completed" and resp["model"] == "qwen3"
    assert resp["id"] == "resp_abc" and resp["created_at"] == 1700000000
    reasoning, message, call_a, call_b = resp["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hm"}]
    assert message["content"] == [{"type": "output_text", "text": "Go.", "annotations": []}]
    assert (call_a["call_id"], call_a["name"], call_a["arguments"]) == ("c1", "exec_command",
                                                                        ARGS_A)
    assert "namespace" not in call_a
    assert (call_b["namespace"], call_b["name"]) == ("ns", "spawn")
    assert resp["usage"] == {"input_tokens": 100,
                             "input_tokens_details": {"cached_tokens": 30, "cache_write_tokens": 0},
                             "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 109}


def test_response_incomplete_on_length() -> None:
    resp = T.response(completion({"content": "abc"}, finish="length"))
    Response.model_validate(resp)
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}


def events(data: bytes, first: int = 0) -> list[dict]:
    """Decode with the SDK's SSE decoder; every event validates, sequence numbers count up."""
    out = []
    for sse in SSEDecoder().iter_bytes(iter([data])):
        payload = sse.json()
        assert payload["type"] == sse.event
        EVENT.validate_python(payload)
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(first, first + len(out)))
    return out


def run(chunks: list[Any]) -> list[dict]:
    stream = T.stream()
    data = b"".join(stream.feed(c) for c in chunks) + stream.finish()
    assert stream.finish() == b""
    evs = events(data)
    final = evs[-1]["response"]
    Response.model_validate(final)
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert final["output"] == done
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.added"] \
        == list(range(len(done)))
    return evs


def summary(evs: list[dict]) -> list[str]:
    short = []
    for e in evs:
        kind = e["type"].removeprefix("response.")
        if "delta" in e:
            short.append(f"{kind} {e['output_index']} {e['delta']}")
        elif kind in ("output_item.added", "output_item.done"):
            short.append(f"{kind} {e['output_index']} {e['item']['type']}")
        else:
            short.append(kind)
    return short


HEAD = ["created", "in_progress"]
TEXT = ["output_item.added 0 message", "content_part.added", "output_text.delta 0 Hel",
        "output_text.delta 0 lo", "output_text.done", "content_part.done",
        "output_item.done 0 message"]


def call_events(index: int, deltas: list[str]) -> list[str]:
    return [f"output_item.added {index} function_call",
            *[f"function_call_arguments.delta {index} {d}" for d in deltas],
            "function_call_arguments.done", f"output_item.done {index} function_call"]


STREAM_CASES = [
    ("text", [*TEXT, "completed"]),
    ("tool_split", [*call_events(0, [ARGS_A[i:i + 4] for i in range(0, len(ARGS_A), 4)]),
                    "completed"]),
    ("parallel_interleaved", call_events(0, [ARGS_A[i:i + 8] for i in range(0, len(ARGS_A), 8)])
     + call_events(1, [ARGS_B]) + ["completed"]),
    ("reasoning_text_tool", ["output_item.added 0 reasoning", "content_part.added",
                             "reasoning_text.delta 0 Let me ", "reasoning_text.delta 0 look.",
                             "reasoning_text.done", "content_part.done",
                             "output_item.done 0 reasoning", "output_item.added 1 message",
                             "content_part.added", "output_text.delta 1 Listing.",
                             "output_text.done", "content_part.done",
                             "output_item.done 1 message", *call_events(2, [ARGS_A]),
                             "completed"]),
    ("malformed", ["output_item.added 0 message", "content_part.added",
                   "output_text.delta 0 fine", "output_text.done", "content_part.done",
                   "output_item.done 0 message", "completed"]),
    ("length", ["output_item.added 0 message", "content_part.added", "output_text.delta 0 abc",
                "output_text.done", "content_part.done", "output_item.done 0 message",
                "incomplete"]),
    ("empty", ["completed"]),
]


@pytest.mark.parametrize(("case", "want"), STREAM_CASES, ids=[c[0] for c in STREAM_CASES])
def test_stream(case: str, want: list[str]) -> None:
    assert summary(run(STREAMS[case])) == HEAD + want


def test_stream_items_and_usage() -> None:
    evs = run(STREAMS["reasoning_text_tool"])
    assert evs[0]["response"]["model"] == "qwen3" and evs[0]["response"]["status"] == "in_progress"
    final = evs[-1]["response"]
    reasoning, message, call = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me look."}]
    assert message["content"][0]["text"] == "Listing."
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "Bash", ARGS_A)
    assert final["usage"]["input_tokens"] == 50
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 10
    assert final["usage"]["total_tokens"] == 70


def test_stream_error_fails_the_response() -> None:
    stream = T.stream()
    started = events(stream.feed(STREAMS["text"][1]))
    body = T.error_body(429, "rate_limit_error", "queue full", None, "queue_full")
    assert body == {"error": {"message": "queue full", "type": "rate_limit_error", "param": None,
                              "code": "queue_full"}}
    error, failed = events(stream.error(body), first=len(started))
    assert error["type"] == "error" and error["message"] == "queue full"
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"] == {"code": "rate_limit_exceeded", "message": "queue full"}
    assert stream.feed(STREAMS["text"][2]) == b"" and stream.finish() == b""


CODEX = ["codex-0.169.0-turn1.json", "codex-0.169.0-turn2-function-call-output.json",
         "codex-0.169.0-namespace-call.json", "codex-0.169.0-turn2-after-prefixd-stream.json"]


@pytest.mark.parametrize("name", CODEX)
def test_real_codex_requests(name: str) -> None:
    captured = client_request(name)
    assert captured["path"] == T.path
    chat = T.request(captured["body"])
    assert chat["stream"] is True
    assert chat["prompt_cache_key"] == captured["body"]["prompt_cache_key"]    # the session id
    assert [m["role"] for m in chat["messages"][:4]] == ["system", "system", "user", "user"]
    names = [t["function"]["name"] for t in chat["tools"]]
    assert "exec_command" in names and "multi_agent_v1.spawn_agent" in names
    assert all(t["type"] == "function" for t in chat["tools"])     # web_search dropped


def test_codex_tool_turn_round_trips() -> None:
    """Turn 2 after prefixd streamed reasoning + text + a call: one assistant message."""
    chat = T.request(client_request(CODEX[3])["body"])
    assistant, tool = chat["messages"][4:6]
    assert assistant == {"role": "assistant", "content": "Running it.",
                         "reasoning_content": "Let me think.",
                         "tool_calls": [tool_call("call_x1", "exec_command",
                                                  json.dumps({"cmd": "echo hi"}))]}
    assert tool["role"] == "tool" and tool["tool_call_id"] == "call_x1"


def test_codex_namespace_call_keeps_its_namespace() -> None:
    chat = T.request(client_request(CODEX[2])["body"])
    call = chat["messages"][-2]["tool_calls"][0]
    assert call["function"]["name"] == "multi_agent_v1.close_agent"
