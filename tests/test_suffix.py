"""Tokenizing only a prompt's new part (`backends/mlx/chat/suffix.py`): interleaved conversations,
edits of earlier messages, branches and odd text give exactly the tokens and message boundaries
of tokenizing whole prompts, while most tokens come from earlier prompts."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from prefixd.backends.mlx.chat.prompt import Renderer
from prefixd.backends.mlx.chat.request import parse_request

ODD = ["Hello  world,\n\n\tthe river's 12,345 é 日本語 🙂", "<|im_start|> inside text",
       "trailing spaces   ", "\n\n\n", "def f(x):\n    return x  # ok", "ÿ\u200b\u00a0nbsp"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Callable[[str], Path]) -> Any:
    return load_tokenizer(tiny_model_dir("qwen3"))


def _text(rng: random.Random) -> str:
    words = ["the", "river", "parser", "cache", "token", "queue", "import", "return", "value"]
    parts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))]
    if rng.random() < 0.3:
        parts.append(rng.choice(ODD))
    return " ".join(parts)


def _conversations(seed: int) -> list[list[dict]]:
    """Prompts of 3 interleaved conversations (6 turns each), then an edit of an earlier
    message and a branch from an earlier turn."""
    rng = random.Random(seed)
    convs = [[{"role": "system", "content": "You are a coding agent. " * 10 + str(c)}]
             for c in range(3)]
    prompts: list[list[dict]] = []
    for _turn in range(6):
        for conv in convs:
            conv.append({"role": "user", "content": _text(rng)})
            prompts.append(list(conv))
            conv.append({"role": "assistant", "content": _text(rng)})
    edited = [dict(m) for m in convs[0]]
    edited[3]["content"] += " (edited)"
    prompts.append([*edited, {"role": "user", "content": "again"}])
    prompts.append([*convs[1][:5], {"role": "user", "content": "a branch"}])
    return prompts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_new_part_tokenizing_equals_whole_prompt_tokenizing(tokenizer: Any, seed: int) -> None:
    suffix = Renderer(tokenizer)
    whole = Renderer(tokenizer)
    assert suffix.suffix is not None and whole.suffix is not None
    whole.suffix = None                    # tokenizes whole prompts (the reference)
    total = 0
    for messages in _conversations(seed):
        req = parse_request("chat", {"messages": messages})
        got, want = suffix.build(req), whole.build(req)
        assert got.tokens == want.tokens
        assert got.boundaries == want.boundaries
        total += len(want.tokens)
    assert suffix.suffix.enabled
    assert suffix.suffix.reused_tokens > total // 2   # most tokens came from earlier prompts
