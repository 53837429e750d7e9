"""The mlx worker app in-process on a tiny real model (real Engine, real loopback server):
OpenAI shapes, streaming, usage, stop strings, sampling, bad input, /tokenize, /v1/cache,
one generation at a time, and a client that disconnects mid-stream."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from mlx_lm.tool_parsers import mistral as mistral_tools
from worker_fixtures import HELLO, NAME, SETTINGS, chat, post, post_get, stream, streamed_text

from prefixd.backends.mlx.chat.oai import ChatOutput, ToolFormat, extract_tool_calls
from prefixd.backends.mlx.chat.prompt import Renderer
from prefixd.backends.mlx.chat.request import GenRequest, Sampling, parse_request
from prefixd.backends.mlx.chat.stops import StopMatcher
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server.app import create_app


async def test_chat_non_stream_shape(client: TestClient) -> None:
    out = await post(client, chat(max_tokens=5))
    assert out["object"] == "chat.completion" and out["model"] == NAME
    assert out["id"].startswith("chatcmpl-")
    (choice,) = out["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    tokens = (await post(client, {"messages": HELLO}, "/tokenize"))["tokens"]
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(tokens) and usage["completion_tokens"] == 5
    assert usage["total_tokens"] == len(tokens) + 5
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < len(tokens)


async def test_chat_stream_matches_non_stream(client: TestClient) -> None:
    whole = await post(client, chat(max_tokens=6))
    events = await stream(client, chat(max_tokens=6, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    first, finish, last = events[0], events[-3], events[-2]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert finish["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert last["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert all("usage" not in e for e in events[:-2])
    assert streamed_text(events) == whole["choices"][0]["message"]["content"]
    # A warm repeat of the same prompt reports the reuse.
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_stream_without_include_usage_has_no_usage(client: TestClient) -> None:
    events = await stream(client, chat(max_tokens=3))
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_completions_shapes(client: TestClient) -> None:
    body = {"prompt": "The river and the sea", "max_tokens": 4, "temperature": 0}
    out = await post(client, body, "/v1/completions")
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 4
    events = await stream(client, body, "/v1/completions")
    assert all(e["object"] == "text_completion" for e in events[:-1])
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == out["choices"][0]["text"]


async def test_max_tokens_default_and_explicit(client: TestClient) -> None:
    out = await post(client, chat())
    assert out["usage"]["completion_tokens"] == SETTINGS.max_tokens_default
    out = await post(client, chat(max_completion_tokens=2))
    assert out["usage"]["completion_tokens"] == 2
    assert out["choices"][0]["finish_reason"] == "length"


async def test_stop_strings_never_leak(client: TestClient) -> None:
    full = (await post(client, chat(max_tokens=12)))["choices"][0]["message"]["content"]
    words = full.split(" ")  # the tiny model only emits " word" tokens
    # A stop string spanning the end of one token and the start of the next.
    stop = words[3][-2:] + " " + words[4][:2]
    expected = full[: full.index(stop)]
    out = await post(client, chat(max_tokens=12, stop=[stop, "never-generated"]))
    assert out["choices"][0]["message"]["content"] == expected
    assert out["choices"][0]["finish_reason"] == "stop"
    events = await stream(client, chat(max_tokens=12, stop=stop))
    assert streamed_text(events) == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    out = await post(client, chat(max_tokens=12, stop="never-generated"))
    assert out["choices"][0]["message"]["content"] == full


async def test_seed_makes_sampling_reproducible(client: TestClient) -> None:
    async def sample(seed: int) -> str:
        body = chat(max_tokens=8, temperature=1.0, seed=seed)
        return (await post(client, body))["choices"][0]["message"]["content"]

    first = await sample(7)
    assert await sample(7) == first
    assert len({first, await sample(8), await sample(9)}) > 1


BAD_BODIES: list[tuple[bytes | dict[str, Any], str | None]] = [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"model": NAME}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": "5"}, "max_tokens"),
    ({"messages": HELLO, "temperature": 9}, "temperature"),
    ({"messages": HELLO, "temperature": True}, "temperature"),
    ({"messages": HELLO, "stop": 3}, "stop"),
    ({"messages": HELLO, "n": 2}, "n"),
    ({"messages": HELLO, "tools": {"a": 1}}, "tools"),
    ({"messages": HELLO, "stream": "yes"}, "stream"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]}]},
     "messages[0].tool_calls[0].function.name"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
    ({"messages": HELLO, "seed": 2**63}, "seed"),
    ({"messages": [{"role": "user", "content": "hi"}] * 4097}, "messages"),
    # parameters the schema accepts and this worker cannot honour
    ({"messages": HELLO, "response_format": {"type": "regex"}}, "response_format"),
    ({"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": []}},
     "response_format.json_schema"),
    ({"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, "response_format.json_schema.schema"),
    ({"messages": HELLO, "tool_choice": "required"}, "tool_choice"),  # and no tools
    ({"messages": HELLO, "tool_choice": {"type": "function", "function": {"name": "f"}},
      "tools": [{"type": "function", "function": {"name": "g"}}]}, "tool_choice"),
    ({"messages": HELLO, "logprobs": 3}, "logprobs"),
    ({"messages": HELLO, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": HELLO, "logit_bias": {"the": 5}}, "logit_bias"),
    ({"messages": HELLO, "logit_bias": {"99999999": 5}}, "logit_bias"),
]

BAD_COMPLETIONS: list[tuple[dict[str, Any], str]] = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [99999999]}, "prompt"),
    ({"prompt": "The river", "echo": True}, "echo"),
    ({"prompt": "The river", "suffix": "and the sea"}, "suffix"),
    ({"prompt": "The river", "logprobs": True}, "logprobs"),
    ({"prompt": "The river", "logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
async def test_bad_input_is_400(client: TestClient, body: bytes | dict[str, Any],
                                param: str | None) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = await client.post("/v1/chat/completions", data=data,
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
async def test_bad_completions_are_400(client: TestClient, body: dict[str, Any],
                                       param: str) -> None:
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param


async def test_other_bad_requests(client: TestClient) -> None:
    long_text = " river" * 5000  # past the tiny model's 4096-token context
    resp = await client.post("/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": long_text}]})
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "context_length_exceeded"
    resp = await client.get("/v1/nothing-here")
    assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found_error"
    resp = await client.post("/tokenize", json={"content": 5})
    assert resp.status == 400


async def test_tokenize(client: TestClient, generator: Generator) -> None:
    messages = [*HELLO, {"role": "assistant", "content": "The river is long."},
                {"role": "user", "content": "And the sea?"}]
    out = await post(client, {"messages": messages}, "/tokenize")
    done = await post(client, chat(messages, max_tokens=1))
    assert len(out["tokens"]) == done["usage"]["prompt_tokens"]
    # Boundaries: where each message's content starts, after its role header, and where the
    # last message's content ends (the generation prompt starts there).
    b = out["boundaries"]
    assert len(b) == 5 and b == sorted(b) and b[0] > 0 and b[-1] < len(out["tokens"])
    tok = generator.loaded.tokenizer
    heads = [tok.decode(out["tokens"][:p]) for p in b]
    assert heads[0] == "<|im_start|>system\n"
    assert heads[1].endswith("You are a cache.<|im_end|>\n<|im_start|>user\n")
    assert heads[2].endswith("<|im_start|>assistant\n")
    assert tok.decode(out["tokens"][b[3]:]).startswith("And the sea?")
    assert tok.decode(out["tokens"][b[4]:]) == "<|im_end|>\n<|im_start|>assistant\n"
    text = await post(client, {"content": " the river"}, "/tokenize")
    assert text["tokens"] == tok.encode(" the river", add_special_tokens=False)


def test_tool_calls_reach_the_template_as_dicts(generator: Generator) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    req = parse_request("chat", {"messages": messages, "tools": tools})
    prompt = Renderer(generator.loaded.tokenizer).build(req)
    text = generator.loaded.tokenizer.decode(prompt.tokens)
    assert '"arguments": {"city": "Oslo"}' in text and "<tool_response>\nsunny" in text
    # the user's content start, the tool result's (inside <tool_response>) and its end (the
    # assistant message, tool calls only, has no content)
    assert len(prompt.boundaries) == 3
    tail = generator.loaded.tokenizer.decode(prompt.tokens[prompt.boundaries[-2]:])
    assert tail.startswith("sunny\n</tool_response>")


def test_boundary_where_a_prefix_renders_differently(generator: Generator) -> None:
    # The template shows reasoning only after the last user turn: rendered alone, the assistant
    # message would carry its <think> block, in the full prompt it does not. Boundaries come
    # from the full prompt: the assistant message's text starts after its role header.
    tok = generator.loaded.tokenizer
    messages = [{"role": "user", "content": "Hi there."},
                {"role": "assistant", "content": "The river.", "reasoning_content": "Hmm."},
                {"role": "user", "content": "And?"}]
    prompt = Renderer(tok).build(parse_request("chat", {"messages": messages}))
    heads = [tok.decode(prompt.tokens[:b]) for b in prompt.boundaries]
    assert heads[0] == "<|im_start|>user\n"
    assert heads[1].endswith("Hi there.<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(prompt.tokens[prompt.boundaries[-2]:]).startswith("And?")
    assert "Hmm." not in tok.decode(prompt.tokens)


def test_extract_tool_calls_and_stop_matcher() -> None:
    text, calls = extract_tool_calls(
        'Checking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert text == "Checking."
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert extract_tool_calls("<tool_call>nope</tool_call>") == ("<tool_call>nope</tool_call>", [])
    # A model format without an end marker, parsed by mlx-lm's own parser for it.
    mistral = ToolFormat("[TOOL_CALLS]", "", mistral_tools.parse_tool_call)
    text, calls = extract_tool_calls('Hi [TOOL_CALLS]weather[ARGS]{"city": "Oslo"}', mistral)
    assert text == "Hi" and calls[0]["function"]["arguments"] == '{"city": "Oslo"}'
    m = StopMatcher(["END"])
    assert [m.feed(t) for t in ("abc E", "N", "Dxyz")] == ["abc ", "", ""]
    assert m.hit and m.held == "ENDxyz"
    m = StopMatcher(["END"])
    assert m.feed("abc EN") == "abc " and m.flush() == "EN"


@pytest.mark.parametrize("pieces", [["a\nb"], ["a", "\n", "b"], ["a\n", "b"]])
def test_stop_strings_end_text_before_a_call(pieces: list[str]) -> None:
    """With `until` (a call's opening marker), a stop string before it ends the text as ever
    (and is named), however the text is split."""
    m = StopMatcher(["\n", "zz"], until="<tool_call>")
    assert "".join(m.feed(p) for p in pieces) == "a" and m.hit and m.matched == "\n"


@pytest.mark.parametrize("pieces", [["Hi <tx"], ["Hi <t", "x"], ["Hi <t"], ["Hi <tool"]])
def test_a_stop_string_a_marker_may_begin_with_ends_text_once_it_is_not_one(pieces) -> None:
    """A stop string that a call's marker begins with is held until the text shows whether
    the marker follows; where it does not (or the reply ends first), it ends the text."""
    m = StopMatcher(["<t"], until="<tool_call>")
    assert "".join(m.feed(p) for p in pieces) + m.flush() == "Hi "
    assert m.hit and m.matched == "<t"


@pytest.mark.parametrize("pieces", [
    ['Hi <tool_call>\n{"a": 1}\n</tool_call>'],               # the marker in one piece
    ["Hi <tool", '_call>\n{"a"', ": 1}\n</tool_call>"],       # split across pieces
    ["Hi ", "<", "tool_call>", "\n", '{"a": 1}', "\n</tool_call>"],
    ["Hi <tool_call", ">\n", '{"a": 1}\n</tool_call>']])
def test_stop_strings_stop_at_a_calls_marker(pieces: list[str]) -> None:
    """From the marker on, no stop string applies (a call is markup, not text): everything
    passes, including a stop string held back just before the marker (`"<"` here) or one the
    marker itself would complete."""
    whole = "".join(pieces)
    for stops in (["\n"], ['"'], ["<t", "\n"], ["all>"], [":"]):
        m = StopMatcher(stops, until="<tool_call>")
        out = "".join(m.feed(p) for p in pieces) + m.flush()
        assert out == whole and not m.hit, stops


async def test_a_call_cut_by_max_tokens_is_held_and_not_text(client: TestClient,
                                                              generator: Generator) -> None:
    # A logit bias makes the tiny model emit the marker token; with tools given, what follows
    # the marker is held back (the grammar makes it the start of a call), and being cut by
    # max_tokens, no valid call: the reply is `length` with neither a call nor its markup.
    marker = generator.loaded.tokenizer.convert_tokens_to_ids("<tool_call>")
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    body = chat(max_tokens=3, tools=tools, logit_bias={str(marker): 100})
    out = await post(client, body)
    assert out["choices"][0]["message"]["content"] == ""
    assert out["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in out["choices"][0]["message"]
    events = await stream(client, body)
    deltas = [e["choices"][0]["delta"].get("content") for e in events[1:-1]]
    assert deltas == [None]  # held back to the end, then only the finish chunk
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def run_output(out: ChatOutput, pieces: list[str]) -> tuple[str, str, list[Any]]:
    fed = [out.feed(p) for p in pieces]
    r, c, calls = out.finish()
    return "".join(f[0] for f in fed) + r, "".join(f[1] for f in fed) + c, calls


def test_chat_output_splits_reasoning_content_and_tool_calls() -> None:
    think = ("<think>", "</think>")
    # The prompt left a think block open.
    out = ChatOutput(think=think, thinking=True)
    assert run_output(out, ["Let me", " see</th", "ink>\n", "\nThe sea."]) == (
        "Let me see", "The sea.", [])
    # The model opens the block itself, split across pieces.
    out = ChatOutput(ToolFormat(), [{"type": "function"}], think, thinking=False)
    reasoning, content, calls = run_output(
        out, ["\n<th", "ink>hmm</think>", "Sure.<tool_call>", '{"name": "f", "arguments": {}}',
              "</tool_call>"])
    assert (reasoning, content) == ("hmm", "Sure.")
    assert calls[0]["function"] == {"name": "f", "arguments": "{}"}
    # No think block: everything is content, including a lookalike.
    out = ChatOutput(think=think)
    assert run_output(out, [" <thin", "king> aloud"]) == ("", " <thinking> aloud", [])


async def test_health_models_metrics(client: TestClient) -> None:
    assert await post_get(client, "/health") == {"status": "ok"}
    models = await post_get(client, "/v1/models")
    assert [m["id"] for m in models["data"]] == [NAME]
    resp = await client.get("/metrics")
    assert resp.status == 200 and "prefixd_" in await resp.text()


async def test_loading_worker_says_so() -> None:
    gen = Generator(SETTINGS)
    try:
        async with TestClient(TestServer(create_app(gen, NAME, SETTINGS))) as c:
            resp = await c.get("/health")
            assert resp.status == 503 and (await resp.json())["status"] == "loading"
            resp = await c.post("/v1/chat/completions", json=chat())
            assert resp.status == 503 and "loading" in (await resp.json())["error"]["message"]
    finally:
        gen.close()


async def test_cache_endpoint_counts_hits(client: TestClient) -> None:
    messages = [{"role": "user", "content": "Cache test: the state of the window layer."}]
    before = await post_get(client, "/v1/cache")
    await post(client, chat(messages, max_tokens=2))
    warm = await post(client, chat(messages, max_tokens=2))
    after = await post_get(client, "/v1/cache")
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert after["hit_tokens_total"] - before["hit_tokens_total"] >= cached
    assert after["worker"]["requests"] - before["worker"]["requests"] == 2
    assert after["bytes_used"] <= after["bytes_budget"]


async def test_concurrent_requests_decode_together_with_the_outputs_of_each_alone(
        client: TestClient) -> None:
    bodies = [chat([{"role": "user", "content": f"Question {i}: the city river?"}],
                   max_tokens=24) for i in range(2)]
    solo = [(await post(client, b))["choices"][0]["message"]["content"] for b in bodies]

    async def timed(body: dict[str, Any]) -> tuple[str, list[float]]:
        resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
        text, stamps = [], []
        async for line in resp.content:
            if line.startswith(b"data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    text.append(delta)
                    stamps.append(time.monotonic())
        return "".join(text), stamps

    (a, ta), (b, tb) = await asyncio.gather(timed(bodies[0]), timed(bodies[1]))
    assert [a, b] == solo  # both answered, neither corrupted by the other
    # the default scheduler (max_active 4) decodes them together, a step each in turn
    assert ta[0] < tb[-1] and tb[0] < ta[-1]


async def test_client_disconnect_stops_generation(client: TestClient) -> None:
    before = await post_get(client, "/v1/cache")
    # Nearly the whole context, so running to completion would take many seconds.
    body = chat([{"role": "user", "content": "Go on forever."}], max_tokens=4000, stream=True)
    resp = await client.post("/v1/chat/completions", json=body)
    seen = 0
    async for line in resp.content:
        seen += line.startswith(b"data: {") and b'"content": " ' in line
        if seen == 3:
            break
    resp.close()  # drop the connection mid-stream
    t0 = time.monotonic()
    out = await post(client, chat(max_tokens=1))  # queued behind the abandoned generation
    waited = time.monotonic() - t0
    after = await post_get(client, "/v1/cache")
    assert out["usage"]["completion_tokens"] == 1
    assert after["worker"]["cancelled"] - before["worker"]["cancelled"] == 1
    generated = after["worker"]["completion_tokens"] - before["worker"]["completion_tokens"]
    assert generated < 200, generated  # stopped a few decode steps after the disconnect
    assert waited < 10.0


def test_parse_request_defaults() -> None:
    req = parse_request("chat", {"messages": HELLO})
    assert isinstance(req, GenRequest) and not req.stream and not req.include_usage
    assert req.sampling == Sampling(temperature=1.0, top_p=1.0)
    req = parse_request("chat", {"messages": [{"role": "developer", "content": "x"},
                                              {"role": "assistant", "content": None,
                                               "reasoning": "hmm"}]})
    assert req.messages[0]["role"] == "system"
    assert req.messages[1] == {"role": "assistant", "content": "", "reasoning_content": "hmm"}


async def test_a_status_read_never_waits_for_the_generation_thread(
        client: TestClient, generator: Generator) -> None:
    """`/v1/cache` and `/health` answer from the last snapshot while the generation thread is
    busy (here: held inside a state call), and a chat request queued meanwhile runs once it
    is free."""
    import threading

    await post(client, chat(max_tokens=2))          # a snapshot exists
    hold, entered = threading.Event(), threading.Event()

    def busy(engine: Any) -> None:
        entered.set()
        assert hold.wait(60)

    call = asyncio.ensure_future(generator.call(busy))
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        info = await asyncio.wait_for(post_get(client, "/v1/cache"), 30)
        assert info["worker"]["requests"] >= 1 and "entries" in info
        assert (await asyncio.wait_for(post_get(client, "/health"), 30))["status"] == "ok"
        queued = asyncio.ensure_future(post(client, chat(max_tokens=2)))
        await asyncio.sleep(0.2)
        assert not queued.done()                    # it needs the thread: it waits
    finally:
        hold.set()
    await call
    assert (await asyncio.wait_for(queued, 60))["choices"]
