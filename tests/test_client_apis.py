"""The official SDKs as clients of a real prefixd: `anthropic` over `/v1/messages` (+ its
`count_tokens`) and `openai` over `/v1/responses`, in front of the fake OpenAI upstream
(tests/fake_upstream.py) whose answers each test scripts (prefixd rebuilds these bodies, so a
`fake` field cannot ride along: `upstream.scripted` holds the upstream's next answers).

What the SDKs see (parsed messages, stream events, tool calls, usage, their own exception
classes for prefixd's errors) and what reached the upstream (the chat body) are both checked,
and so is the prefix report over two turns of captured Claude Code and Codex requests."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from chat_chunks import client_request
from fake_upstream import FakeUpstream
from proxy_fixtures import StartProxy

from prefixd.backends.managed import ManagedBackend
from prefixd.backends.supervision.states import ProcState
from prefixd.proxy.server import Server, make_proxy
from prefixd.proxy.settings import Settings

KEY = "sk-local"
TIMEOUT = 20.0
ARGS = '{"command": "echo hi", "description": "say hi"}'
BASH = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"},
                                                         "description": {"type": "string"}},
                         "required": ["command"]}}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                       "required": ["cmd"]}, "strict": False}


def reply(content: str | None = None, reasoning: str | None = None,
          calls: list[tuple[str, str, str]] = (), cached: int = 0, prompt: int = 120,
          piece: int = 5) -> dict[str, Any]:
    """A scripted upstream answer: streamed with every string split into `piece`-char chunks."""
    return {"reply": {"content": content, "reasoning": reasoning,
                      "tool_calls": [{"id": i, "name": n, "arguments": a} for i, n, a in calls]},
            "usage": {"prompt_tokens": prompt, "cached_tokens": cached}, "piece": piece}


class Prefixd:
    """A started prefixd in front of the fake upstream, and the SDK clients pointed at it."""

    def __init__(self, server: Server, upstream: FakeUpstream) -> None:
        self.server, self.upstream = server, upstream
        self.base = f"http://127.0.0.1:{server.port}"

    def anthropic(self, key: str = KEY, bearer: bool = False) -> anthropic.AsyncAnthropic:
        auth = {"auth_token": key} if bearer else {"api_key": key}
        return anthropic.AsyncAnthropic(base_url=self.base, max_retries=0, timeout=TIMEOUT,
                                        **auth)

    def openai(self, key: str = KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0,
                                  timeout=TIMEOUT)

    async def debug_lane(self, lane: str) -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s, s.get(
                f"{self.base}/debug/prefix/{lane}",
                headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["reports"]


@pytest.fixture
async def prefixd(upstream: FakeUpstream, start_proxy: StartProxy) -> AsyncIterator[Prefixd]:
    server = await start_proxy(upstream.url, api_key=KEY,
                               model_aliases={"claude-*": "fake", "gpt-*": "fake",
                                              "local-model": "fake"})
    yield Prefixd(server, upstream)


# --- Anthropic Messages ----------------------------------------------------------------------


async def test_anthropic_plain_message_with_cache_reads(prefixd: Prefixd) -> None:
    prefixd.upstream.scripted.append(reply("Paris is the capital.", cached=96))
    async with prefixd.anthropic() as client:
        raw = await client.messages.with_raw_response.create(
            model="claude-sonnet-5", max_tokens=64, system="Be brief.",
            messages=[{"role": "user", "content": "Capital of France?"}])
        msg = await raw.parse()
    assert isinstance(msg, anthropic.types.Message)
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "Paris is the capital."
    assert msg.stop_reason == "end_turn"
    assert msg.usage.input_tokens == 120 - 96 and msg.usage.cache_read_input_tokens == 96
    assert raw.headers["X-Prefixd-Backend"] == "up"
    sent = prefixd.upstream.received[-1]          # routed by the alias claude-* -> fake
    assert sent["max_tokens"] == 64 and not sent.get("stream")
    assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Capital of France?"}]


async def test_aliased_model_reaches_the_upstream_as_the_served_name(prefixd: Prefixd) -> None:
    prefixd.upstream.scripted += [reply("a"), reply("b")]
    async with prefixd.anthropic() as client:
        await client.messages.create(model="claude-sonnet-5", max_tokens=8,
                                     messages=[{"role": "user", "content": "hi"}])
    async with prefixd.openai() as client:
        await client.responses.create(model="gpt-5-codex", input="hi")
    assert [b["model"] for b in prefixd.upstream.received] == ["fake", "fake"]


async def test_anthropic_stream_and_final_message(prefixd: Prefixd) -> None:
    prefixd.upstream.scripted.append(reply("Hello there, friend.", reasoning="Greet them.",
                                           cached=40, prompt=50, piece=3))
    async with prefixd.anthropic(bearer=True) as client, client.messages.stream(
            model="claude-haiku-5-5", max_tokens=64,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "hi"}]) as stream:
        assert stream.response.headers["X-Prefixd-Backend"] == "up"
        texts = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert len(texts) > 1 and "".join(texts) == "Hello there, friend."
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Greet them."
    assert final.content[1].text == "Hello there, friend."
    assert final.stop_reason == "end_turn"
    assert final.usage.cache_read_input_tokens == 40 and final.usage.input_tokens == 10
    sent = prefixd.upstream.received[-1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.parametrize("streamed", [True, False])
async def test_anthropic_tool_use_round_trip(prefixd: Prefixd, streamed: bool) -> None:
    """The upstream's chat tool call arrives split over many chunks; the SDK sees one
    `tool_use` block with its input parsed; the tool_result goes back as a `tool` message."""
    up = prefixd.upstream
    up.scripted += [reply("Running it.", calls=[("call_x1", "Bash", ARGS)], piece=4),
                    reply("It printed hi.")]
    question = [{"role": "user", "content": "please run echo hi"}]
    async with prefixd.anthropic() as client:
        if streamed:
            async with client.messages.stream(model="claude-sonnet-5", max_tokens=256,
                                              tools=[BASH], messages=question) as stream:
                kinds = [e.type async for e in stream]
                first = await stream.get_final_message()
            assert "input_json" in kinds            # the SDK's own partial-JSON accumulator
        else:
            first = await client.messages.create(model="claude-sonnet-5", max_tokens=256,
                                                 tools=[BASH], messages=question)
        assert first.stop_reason == "tool_use"
        assert [b.type for b in first.content] == ["text", "tool_use"]
        use = first.content[1]
        assert (use.id, use.name) == ("call_x1", "Bash")
        assert use.input == {"command": "echo hi", "description": "say hi"}

        history = [*question, {"role": "assistant", "content": first.content},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": "hi\n"}]}]
        second = await client.messages.create(model="claude-sonnet-5", max_tokens=256,
                                              tools=[BASH], messages=history)
    assert second.content[0].text == "It printed hi."
    sent = up.received[-1]["messages"]
    assert sent[1] == {"role": "assistant", "content": "Running it.", "tool_calls": [
        {"id": "call_x1", "type": "function", "function": {"name": "Bash", "arguments": ARGS}}]}
    assert sent[2] == {"role": "tool", "tool_call_id": "call_x1", "content": "hi\n"}
    assert up.received[-1]["tools"][0]["function"]["name"] == "Bash"


async def test_anthropic_errors_are_the_sdks_exceptions(prefixd: Prefixd) -> None:
    up = prefixd.upstream
    hi = [{"role": "user", "content": "hi"}]
    async with prefixd.anthropic() as client:
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model="fake", max_tokens=16, messages=[])
        assert bad.value.status_code == 400
        assert bad.value.body == {"type": "error", "error": {
            "type": "invalid_request_error", "message": "'messages' must be a non-empty list"}}

        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.messages.create(model="llama-unknown", max_tokens=16, messages=hi)
        assert missing.value.body["error"]["type"] == "not_found_error"
        assert "llama-unknown" in missing.value.body["error"]["message"]

        up.scripted.append({"status": 500})
        with pytest.raises(anthropic.InternalServerError) as failed:
            await client.messages.create(model="fake", max_tokens=16, messages=hi)
        assert failed.value.status_code == 500
        assert failed.value.body == {"type": "error", "error": {
            "type": "api_error", "message": "fake failure 500"}}

        up.scripted.append({"status": 500})              # a stream fails before it starts
        with pytest.raises(anthropic.InternalServerError):
            async with client.messages.stream(model="fake", max_tokens=16, messages=hi) as s:
                await s.get_final_message()

        up.scripted.append({"status": 429})
        with pytest.raises(anthropic.RateLimitError):
            await client.messages.create(model="fake", max_tokens=16, messages=hi)

    for bearer in (False, True):
        async with prefixd.anthropic(key="sk-wrong", bearer=bearer) as client:
            with pytest.raises(anthropic.AuthenticationError) as denied:
                await client.messages.create(model="fake", max_tokens=16, messages=hi)
            assert denied.value.body["error"]["type"] == "authentication_error"
            with pytest.raises(anthropic.AuthenticationError):
                await client.messages.count_tokens(model="fake", messages=hi)
    assert len(up.received) == 3                        # only the three upstream failures


async def test_anthropic_mid_stream_failure_raises(prefixd: Prefixd) -> None:
    """The upstream dies after the first chunk: the SDK gets Anthropic's `error` event."""
    first = {"id": "c1", "object": "chat.completion.chunk", "model": "fake",
             "choices": [{"index": 0, "delta": {"content": "partial "}}]}
    prefixd.upstream.scripted.append({"raw": ["data: " + json.dumps(first) + "\n\n"],
                                      "drop": True})
    texts = []
    async with prefixd.anthropic() as client:
        with pytest.raises(anthropic.APIStatusError) as failed:
            async with client.messages.stream(model="fake", max_tokens=16,
                                              messages=[{"role": "user", "content": "hi"}]) as s:
                async for t in s.text_stream:
                    texts.append(t)
    assert texts == ["partial "]
    assert failed.value.body["type"] == "error"
    assert failed.value.body["error"]["type"] == "api_error"


async def test_sdk_streams_wait_in_the_queue(prefixd: Prefixd) -> None:
    """Streams that wait for the backend get `: queued position=N` comments before the first
    event; both SDKs skip them and parse the answer that follows."""
    up = prefixd.upstream
    up.scripted += [{**reply("first"), "hold": True}, reply("second"), reply("third")]
    hi = [{"role": "user", "content": "hi"}]
    async with prefixd.anthropic() as a, prefixd.openai() as o:
        held = asyncio.create_task(a.messages.create(model="fake", max_tokens=8, messages=hi))
        await up.wait_received(1)

        async def anthropic_stream() -> str:
            async with a.messages.stream(model="fake", max_tokens=8, messages=hi) as s:
                return (await s.get_final_message()).content[0].text

        async def responses_stream() -> str:
            events = [e async for e in await o.responses.create(model="fake", input="hi",
                                                                 stream=True)]
            return events[-1].response.output_text

        waiting = [asyncio.create_task(anthropic_stream())]
        await _queued(prefixd, 1)
        waiting.append(asyncio.create_task(responses_stream()))
        await _queued(prefixd, 2)
        up.release.set()
        assert (await held).content[0].text == "first"
        assert [await t for t in waiting] == ["second", "third"]


async def _queued(prefixd: Prefixd, n: int) -> None:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        for _ in range(200):
            async with s.get(prefixd.base + "/status") as r:
                if (await r.json())["backends"][0]["queue_depth"] >= n:
                    return
            await asyncio.sleep(0.02)
    raise AssertionError(f"never {n} waiting")


async def test_responses_mid_stream_failure(prefixd: Prefixd) -> None:
    """The upstream dies mid-answer: the SDK reads Responses' `error` and `response.failed`."""
    first = {"id": "c1", "object": "chat.completion.chunk", "model": "fake",
             "choices": [{"index": 0, "delta": {"content": "partial "}}]}
    prefixd.upstream.scripted.append({"raw": ["data: " + json.dumps(first) + "\n\n"],
                                      "drop": True})
    async with prefixd.openai() as client:
        events = [e async for e in await client.responses.create(model="fake", input="hi",
                                                                   stream=True)]
    kinds = [e.type for e in events]
    assert "response.output_text.delta" in kinds
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-1].response.status == "failed"
    assert events[-1].response.error.code == "server_error"


async def test_count_tokens_without_a_tokenizer_is_an_estimate(prefixd: Prefixd) -> None:
    async with prefixd.anthropic() as client:
        raw = await client.messages.with_raw_response.count_tokens(
            model="claude-sonnet-5", system="Be brief.", tools=[BASH],
            messages=[{"role": "user", "content": "hello " * 200}])
        count = await raw.parse()
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.count_tokens(model="nope",
                                               messages=[{"role": "user", "content": "x"}])
    assert raw.headers["X-Prefixd-Estimate"] == "chars/4"
    assert 300 < count.input_tokens < 600
    assert prefixd.upstream.received == []               # counting generates nothing


@pytest.mark.slow
async def test_count_tokens_is_exact_with_a_real_worker(
        tiny_model_dir: Callable[[str], Path]) -> None:
    """A managed worker on a tiny Qwen3 tokenizes through its chat template: the count is
    the worker's own prompt length, the one its chat template renders."""
    from transformers import AutoTokenizer

    model = tiny_model_dir("qwen3")
    settings = Settings(_env_file=None, use_system_blas=False, backends=[
        {"name": "tiny", "kind": "mlx", "model": str(model), "models": ["tiny"]}])
    managed = ManagedBackend(settings.backends[0], settings)
    server = Server(make_proxy(settings, [managed]))
    await server.start("127.0.0.1", 0)
    try:
        await managed.wait_for(ProcState.READY, timeout=120)
        messages = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "What is the capital of France? " * 5}]
        async with anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{server.port}",
                                            api_key="x", max_retries=0, timeout=30) as client:
            raw = await client.messages.with_raw_response.count_tokens(
                model="tiny", system=messages[0]["content"], messages=messages[1:])
        assert "X-Prefixd-Estimate" not in raw.headers
        tok = AutoTokenizer.from_pretrained(str(model))
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert (await raw.parse()).input_tokens == len(tok.encode(text, add_special_tokens=False))
    finally:
        await server.shutdown(5.0)


# --- OpenAI Responses ------------------------------------------------------------------------


async def test_responses_plain(prefixd: Prefixd) -> None:
    prefixd.upstream.scripted.append(reply("Paris.", cached=64, prompt=80))
    async with prefixd.openai() as client:
        resp = await client.responses.create(model="gpt-5-codex", instructions="Be brief.",
                                             input="Capital of France?", max_output_tokens=32)
    assert resp.status == "completed" and resp.output_text == "Paris."
    assert [o.type for o in resp.output] == ["message"]
    assert resp.usage.input_tokens == 80
    assert resp.usage.input_tokens_details.cached_tokens == 64
    # the request's own fields, repeated (before: instructions None, max_output_tokens None)
    assert (resp.instructions, resp.max_output_tokens, resp.tools) == ("Be brief.", 32, [])
    sent = prefixd.upstream.received[-1]
    assert sent["max_tokens"] == 32
    assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Capital of France?"}]


async def test_responses_stream_with_a_function_call(prefixd: Prefixd) -> None:
    up = prefixd.upstream
    args = '{"cmd": "echo hi"}'
    up.scripted += [reply(reasoning="I should run it.", calls=[("call_7", "exec_command", args)],
                          cached=30, prompt=40, piece=3),
                    reply("It printed hi.")]
    question = [{"role": "user", "content": "please run echo hi"}]
    async with prefixd.openai() as client:
        stream = await client.responses.create(model="fake", input=question, tools=[EXEC],
                                               tool_choice="required", stream=True,
                                               prompt_cache_key="sess-1")
        events = [e async for e in stream]
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) > 1 and "".join(deltas) == args
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert done.arguments == args
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response
        # the request's own fields, repeated in every response object of the stream (before:
        # tool_choice auto and no tools whatever was asked)
        for r in (events[0].response, final):
            assert (r.tool_choice, [t.name for t in r.tools]) == ("required", ["exec_command"])
        assert [o.type for o in final.output] == ["reasoning", "function_call"]
        call = final.output[1]
        assert (call.call_id, call.name, call.arguments) == ("call_7", "exec_command", args)
        assert final.usage.input_tokens == 40
        assert final.usage.input_tokens_details.cached_tokens == 30
        assert final.usage.output_tokens > 0

        history = [*question, *[o.model_dump(exclude_none=True) for o in final.output],
                   {"type": "function_call_output", "call_id": call.call_id, "output": "hi\n"}]
        second = await client.responses.create(model="fake", input=history, tools=[EXEC],
                                               prompt_cache_key="sess-1")
    assert second.output_text == "It printed hi."
    sent = up.received[-1]
    assert sent["messages"][1:] == [
        {"role": "assistant", "content": None, "reasoning_content": "I should run it.",
         "tool_calls": [{"id": "call_7", "type": "function",
                         "function": {"name": "exec_command", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "hi\n"}]
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "exec_command", "description": "Run a command",
        "parameters": EXEC["parameters"], "strict": False}}]


async def test_responses_errors(prefixd: Prefixd) -> None:
    async with prefixd.openai() as client:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.responses.create(model="fake", input="hi",
                                          previous_response_id="resp_123")
        assert bad.value.body["param"] == "previous_response_id"
        assert "stores no responses" in bad.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="qwen-unknown", input="hi")
        prefixd.upstream.scripted.append({"status": 500})
        with pytest.raises(openai.InternalServerError):
            await client.responses.create(model="fake", input="hi")
    async with prefixd.openai(key="sk-wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.responses.create(model="fake", input="hi")


# --- prefix reports over real agent requests --------------------------------------------------


def _billing(body: dict[str, Any], cch: str) -> dict[str, Any]:
    """Claude Code's billing line with the per-request `cch=` hash it carries against
    Anthropic's API (the capture, against a local URL, has none)."""
    body = copy.deepcopy(body)
    line = body["system"][0]["text"]
    assert line.startswith("x-anthropic-billing-header:") and "cch=" not in line
    body["system"][0]["text"] = f"{line} cch={cch};"
    return body


async def _post(prefixd: Prefixd, path: str, captured: dict[str, Any],
                body: dict[str, Any]) -> tuple[int, str, str]:
    headers = {k: v for k, v in captured["headers"].items()
               if k.lower() not in ("authorization", "accept-encoding", "connection")}
    async with aiohttp.ClientSession() as s, s.post(
            prefixd.base + path, json=body, headers={**headers, "x-api-key": KEY}) as r:
        return r.status, r.headers.get("X-Prefixd-Prefix", ""), await r.text()


async def test_claude_code_turns_keep_their_prefix(prefixd: Prefixd) -> None:
    """Two turns of a captured Claude Code conversation whose billing line changes its
    `cch=` between them: the client's prompt MUTATED, R1 strips the line, and what was
    sent is an APPEND. The upstream never sees the billing line."""
    one = client_request("claude-code-2.1.197-turn1.json")
    two = client_request("claude-code-2.1.197-turn2-after-prefixd-stream.json")
    turn1 = _billing(one["body"], "fa690")
    # turn 2 as this session would send it: the captured turn 2 (another session) with this
    # session's metadata, after prefixd streamed thinking + text + a Bash call.
    turn2 = _billing({**two["body"], "metadata": one["body"]["metadata"]}, "0aaa9")
    up = prefixd.upstream
    up.scripted += [reply("Running it.", reasoning="Let me think.",
                          calls=[("call_x1", "Bash", ARGS)], prompt=4000),
                    reply("Done: it printed hi.", prompt=4100, cached=3990)]

    status, header1, text1 = await _post(prefixd, "/v1/messages?beta=true", one, turn1)
    assert status == 200, text1
    assert '"name":"Bash"' in text1 and "event: message_stop" in text1
    status, header2, text2 = await _post(prefixd, "/v1/messages?beta=true", one, turn2)
    assert status == 200, text2

    assert header1.startswith("verdict=NEW")
    assert header2.startswith("verdict=MUTATED;cause=anthropic_billing_header;"
                              "fixed=strip_billing_header;sent=APPEND;"), header2
    for body in up.received:
        assert "x-anthropic-billing-header" not in json.dumps(body)
        assert "cch=" not in json.dumps(body)
    lane = "cc:" + one["headers"]["X-Claude-Code-Session-Id"]
    reports = await prefixd.debug_lane(lane)
    assert [r["turn"] for r in reports] == [1, 2]
    assert reports[1]["verdict"] == "MUTATED" and reports[1]["sent_verdict"] == "APPEND"


async def test_codex_turns_append(prefixd: Prefixd) -> None:
    """Two turns of a captured Codex conversation (a reasoning item and an exec_command call
    answered in between): an APPEND, in the lane of Codex's session id."""
    one = client_request("codex-0.169.0-turn1.json")
    two = client_request("codex-0.169.0-turn2-function-call-output.json")
    prefixd.upstream.scripted += [
        reply(reasoning="I should run echo.", calls=[("call_1", "exec_command",
                                                      '{"cmd": "echo hi"}')], prompt=3000),
        reply("It printed hi.", prompt=3100, cached=2990)]
    status, header1, text1 = await _post(prefixd, "/v1/responses", one, one["body"])
    assert status == 200, text1
    assert "response.function_call_arguments.done" in text1
    status, header2, text2 = await _post(prefixd, "/v1/responses", one, two["body"])
    assert status == 200, text2
    assert header1.startswith("verdict=NEW")
    assert header2.startswith("verdict=APPEND;cause=-;sent=APPEND;"), header2
    reports = await prefixd.debug_lane("s:" + one["headers"]["session-id"])
    assert [r["verdict"] for r in reports] == ["NEW", "APPEND"]
