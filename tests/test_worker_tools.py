"""Tools on a chat template that ignores them (SmolLM2's, the built-in default model's): the
worker writes tool definitions, tool calls and tool results into the conversation as
Hermes-style text, so they reach the model and the `<tool_call>` parser reads its answers."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from worker_fixtures import SETTINGS, post, stream

from prefixd.backends.mlx.chat.oai import ToolFormat
from prefixd.backends.mlx.chat.request import parse_request
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server.app import create_app
from tests.worker_fixtures import loaded

# HuggingFaceTB/SmolLM2-135M-Instruct's chat template: no `tools`, no `tool_calls`.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}
TURN1 = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather?"}]
TURN2 = [*TURN1, {"role": "assistant", "content": "", "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
         {"role": "tool", "tool_call_id": "c2", "content": "warm"}]


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Callable[[str], Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Generator]:
    """The tiny qwen3 model with SmolLM2's template."""
    folder = tmp_path_factory.mktemp("plain") / "model"
    shutil.copytree(tiny_model_dir("qwen3"), folder)
    (folder / "chat_template.jinja").write_text(SMOLLM2_TEMPLATE)
    gen = Generator(SETTINGS)
    loaded(gen, str(folder))
    yield gen
    gen.close()


@pytest.fixture
async def plain_client(plain: Generator) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(plain, "plain", SETTINGS))) as c:
        yield c


def _text(gen: Generator, body: dict[str, Any]) -> tuple[str, list[int]]:
    assert gen.loaded is not None
    prompt = gen.loaded.renderer.build(parse_request("chat", body))
    return gen.loaded.tokenizer.decode(prompt.tokens), prompt.tokens


def test_the_probe_tells_templates_apart(plain: Generator, generator: Generator) -> None:
    assert plain.loaded is not None and generator.loaded is not None
    assert not plain.loaded.renderer.native_tools
    assert plain.loaded.renderer.tool_format() == ToolFormat()  # what the fallback asks for
    assert generator.loaded.renderer.native_tools  # the tiny ChatML template renders tools


def test_tools_calls_and_results_become_text(plain: Generator) -> None:
    text, _ = _text(plain, {"messages": TURN2, "tools": TOOLS})
    assert text.startswith("<|im_start|>system\nYou help.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call><|im_end|>') in text
    # consecutive results share one user turn
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
            "<tool_response>\nwarm\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert "<|im_start|>tool" not in text
    # no system message: the tools block is one
    text, _ = _text(plain, {"messages": TURN1[1:], "tools": TOOLS})
    assert text.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in text


def test_tool_choice_none_drops_the_tools_not_the_history(plain: Generator) -> None:
    text, _ = _text(plain, {"messages": TURN2, "tools": TOOLS, "tool_choice": "none"})
    assert "<tools>" not in text and '<tool_call>\n{"name": "weather"' in text
    plain_text, _ = _text(plain, {"messages": TURN1, "tools": TOOLS, "tool_choice": "none"})
    assert plain_text == _text(plain, {"messages": TURN1})[0]


def test_the_next_turn_extends_the_previous_prompt(plain: Generator) -> None:
    """The rewrite is stable: a turn's prompt (without its generation prompt) is a prefix of
    the next turn's, so the cache reuses it."""
    _, first = _text(plain, {"messages": TURN1, "tools": TOOLS})
    _, second = _text(plain, {"messages": TURN2, "tools": TOOLS})
    header = len(plain.loaded.tokenizer.encode("<|im_start|>assistant\n",
                                               add_special_tokens=False))
    assert second[:len(first)] == first and len(second) > len(first) + header


async def test_replies_go_through_the_tool_call_parser(plain_client: TestClient,
                                                       plain: Generator) -> None:
    # A logit bias makes the tiny model emit the marker token: with tools, what follows the
    # marker (the start of a call, by the grammar) is held back to the end (then, cut by
    # max_tokens, a cut call: neither a call nor text).
    marker = plain.loaded.tokenizer.convert_tokens_to_ids("<tool_call>")
    body = {"messages": TURN1, "tools": TOOLS, "max_tokens": 2, "temperature": 0,
            "logit_bias": {str(marker): 100}}
    out = await post(plain_client, body)
    assert out["choices"][0]["message"]["content"] == ""
    assert out["choices"][0]["finish_reason"] == "length"
    held = await stream(plain_client, body)
    assert [e["choices"][0]["delta"].get("content") for e in held[1:-1]] == [
        None]  # held back to the end, then only the finish chunk
    free = await stream(plain_client, {**body, "tools": None})
    assert [e["choices"][0]["delta"].get("content") for e in free[1:-1]] == [
        "<tool_call>", "<tool_call>", None]
