"""The tiny-model factory: folders load offline, have the intended cache classes, render the
Qwen3-style chat template, and generate text that re-encodes to the generated ids."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from prefixd.backends.mlx.model import tinytok
from prefixd.backends.mlx.model.tiny import ARCHS, TINY_VOCAB, build_model, main

EXPECTED_CACHES = {
    "qwen3": ["KVCache"] * 2,
    "gemma3_text": ["RotatingKVCache", "KVCache"] * 2,
    "qwen3_next": ["ArraysCache"] * 3 + ["KVCache"],
    "qwen3_5": ["ArraysCache"] * 3 + ["KVCache"],
    "falcon_h1": ["CacheList(ArraysCache,KVCache)"] * 2,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a timezone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    }
]
TOOL_CALL = {"id": "c1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}


def _cache_name(cache: object) -> str:
    inner = getattr(cache, "caches", None)
    if inner is None:
        return type(cache).__name__
    return f"{type(cache).__name__}({','.join(type(c).__name__ for c in inner)})"


@pytest.fixture(scope="module")
def qwen3_tokenizer(tiny_model_dir: Callable[[str], Path]):
    return mlx_lm.load(str(tiny_model_dir("qwen3")))[1]


def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_with_intended_caches_and_round_trips(
    arch: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    model, tokenizer, config = mlx_lm.load(str(tiny_model_dir(arch)), return_config=True)
    assert config["model_type"] == arch
    caches = make_prompt_cache(model)
    assert [_cache_name(c) for c in caches] == EXPECTED_CACHES[arch]
    if arch == "gemma3_text":
        assert caches[0].max_size == 128

    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about the cache."}]
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    ids, text = [], ""
    for response in stream_generate(model, tokenizer, prompt, max_tokens=20,
                                     sampler=make_sampler(temp=0.0)):
        ids.append(response.token)
        text += response.text
    assert len(ids) == 20
    # The first token keeps its leading space (the space-dropping detokenizer is not used).
    assert text.startswith(" ") and text == tokenizer.decode(ids)
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    # A client sending the reply back reproduces prompt + generated ids as the next prefix.
    follow_up = [*messages, {"role": "assistant", "content": text},
                 {"role": "user", "content": "And then?"}]
    again = tokenizer.apply_chat_template(follow_up, tools=TOOLS, add_generation_prompt=True)
    assert again[: len(prompt) + len(ids)] == prompt + ids


def test_template_renders_tools_calls_results_and_generation_prompt(qwen3_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What time is it?"}]},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c2", "content": "13:00"},
    ]
    text = _render(qwen3_tokenizer, messages, tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert "<|im_start|>user\nWhat time is it?<|im_end|>\n" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"tz": "UTC"}}\n</tool_call><|im_end|>\n') in text
    # Consecutive tool results share one user turn.
    assert ("<|im_start|>user\n<tool_response>\n12:00\n</tool_response>\n"
            "<tool_response>\n13:00\n</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\n")
    no_think = _render(qwen3_tokenizer, messages[:2], add_generation_prompt=True,
                       enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not no_think.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    call_as_dict = {"function": {"name": "get_time", "arguments": {"tz": "UTC"}}}
    as_dict = _render(qwen3_tokenizer, [{"role": "assistant", "content": "ok",
                                         "tool_calls": [call_as_dict]}])
    assert 'ok\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}' in as_dict


def test_template_keeps_reasoning_only_after_last_user_query(qwen3_tokenizer) -> None:
    turn = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "", "reasoning_content": "plan A",
         "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "assistant", "content": " noon", "reasoning_content": "read it"},
    ]
    within = _render(qwen3_tokenizer, turn, tools=TOOLS)
    assert "<|im_start|>assistant\n<think>\nplan A\n</think>\n\n<tool_call>" in within
    assert "<|im_start|>assistant\n<think>\nread it\n</think>\n\n noon<|im_end|>" in within
    later = _render(qwen3_tokenizer, [*turn, {"role": "user", "content": "next"}],
                    tools=TOOLS, add_generation_prompt=True)
    assert "<think>" not in later
    assert "<|im_start|>assistant\n noon<|im_end|>\n<|im_start|>user\nnext" in later
    inline_think = {"role": "assistant", "content": "<think>\nhm\n</think>\n\nA"}
    inline = _render(qwen3_tokenizer, [{"role": "user", "content": "q"}, inline_think])
    assert inline.endswith("<|im_start|>assistant\n<think>\nhm\n</think>\n\nA<|im_end|>\n")


def test_tokenizer_is_deterministic_across_processes() -> None:
    code = ("from prefixd.backends.mlx.model import tinytok; "
            f"print(tinytok.train_tokenizer({TINY_VOCAB}).to_str())")
    other = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, env={"PYTHONHASHSEED": "7"}, timeout=60).stdout.strip()
    assert other == tinytok.train_tokenizer(TINY_VOCAB).to_str()


def test_cli_writes_a_loadable_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["qwen3", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    with pytest.raises(SystemExit):
        main(["llama", str(tmp_path / "x")])


def test_build_model_is_seeded() -> None:
    from mlx.utils import tree_flatten

    def params(seed: int) -> dict:
        return dict(tree_flatten(build_model("qwen3", seed=seed).parameters()))

    first, again, other = params(0), params(0), params(1)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert first.keys() == again.keys()
    assert all(mx.array_equal(first[k], again[k]).item() for k in first)
    assert not mx.array_equal(first[name], other[name]).item()
