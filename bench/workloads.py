"""The multi-turn request sequences of `bench/multiturn.py`, one generator per scenario.

Owns: what each scenario sends (messages, tools, seed) and how the client side of each
conversation evolves from the server's replies: appending replies, fabricating tool calls and
tool results, stripping reasoning, editing an earlier message, interleaving conversations.
Pure data: no HTTP, no timing, no model. Text is built from the tiny tokenizer's word list,
where one word is one token, so `n` words is about `n` prompt tokens.

A scenario is a generator: it yields a `Step` (a request body without the sampling fields)
and receives the server's `Reply` for it, so the next request can depend on the reply just as
a real client's does. Both servers see the same code; with greedy decoding the replies (and so
the prompts) are the same on both.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from prefixd.backends.mlx.model.tinytok import WORDS


@dataclass(frozen=True)
class Step:
    """One request: `body` holds messages (and tools/seed); `label` names it in the tables."""

    label: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Reply:
    text: str


Scenario = Generator[Step, Reply, None]


@dataclass(frozen=True)
class ScenarioSpec:
    key: str
    title: str
    make: Callable[[float, random.Random], Scenario]
    # Empty: every model; else only these architectures (by model folder name).
    models: tuple[str, ...] = field(default=())


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def _n(scale: float, tokens: int) -> int:
    return max(8, round(tokens * scale))


def _step(label: str, messages: list[dict[str, Any]], **extra: Any) -> Step:
    # A deep copy: servers may rewrite the body (stock mlx-lm parses tool-call arguments in
    # place) and the scenario keeps mutating its own history.
    return Step(label, json.loads(json.dumps({"messages": messages, **extra})))


def exact_repeat(scale: float, rng: random.Random, seed: int | None = None,
                 size: int = 3000, repeats: int = 4) -> Scenario:
    """(a)/(h) The same ~`size`-token prompt sent `repeats` times (with `seed` if given)."""
    messages = [{"role": "system", "content": words(rng, _n(scale, 300))},
                {"role": "user", "content": words(rng, _n(scale, size - 300))}]
    extra = {} if seed is None else {"seed": seed}
    for i in range(repeats):
        yield _step(f"repeat{i}", messages, **extra)


def chat(scale: float, rng: random.Random, turns: int = 6, system: int = 400,
         first: int = 600, per_turn: int = 200) -> Scenario:
    """(b) Append-only chat: each turn appends the reply and ~`per_turn` new user tokens."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(rng, _n(scale, system))},
                                      {"role": "user", "content": words(rng, _n(scale, first))}]
    for t in range(turns):
        reply = yield _step(f"turn{t}", messages)
        messages += [{"role": "assistant", "content": reply.text},
                     {"role": "user", "content": words(rng, _n(scale, per_turn))}]


TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_command", "description": "Run a shell command and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]}}},
]


def tool_loop(scale: float, rng: random.Random, steps: int = 8) -> Scenario:
    """(c) Agent loop: each reply becomes an assistant message with `tool_calls` followed by a
    `tool` result, so every request after the first ends with a tool message."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": words(rng, _n(scale, 800))},
        {"role": "user", "content": words(rng, _n(scale, 300))}]
    for s in range(steps):
        reply = yield _step(f"step{s}", messages, tools=TOOLS)
        call_id = f"call_{s}"
        # json.dumps with default separators is what the chat template's tojson prints, so the
        # servers that parse the arguments (stock mlx-lm) render the same bytes as those that
        # do not.
        args = json.dumps({"path": f"src/{rng.choice(WORDS)}.py"})
        messages += [
            {"role": "assistant", "content": reply.text, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "read_file", "arguments": args}}]},
            {"role": "tool", "tool_call_id": call_id, "content": words(rng, _n(scale, 250))}]


def thinking(scale: float, rng: random.Random, turns: int = 6) -> Scenario:
    """(d) A reasoning model whose client drops the reasoning from history: the first half of
    each reply stands for the `<think>` block, only the second half is sent back."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(rng, _n(scale, 400))},
                                      {"role": "user", "content": words(rng, _n(scale, 600))}]
    for t in range(turns):
        reply = yield _step(f"turn{t}", messages)
        kept = reply.text.split()
        answer = " ".join(kept[len(kept) // 2:]) or reply.text
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": words(rng, _n(scale, 200))}]


def edit(scale: float, rng: random.Random, turns: int = 6, edit_at: int = 3,
         pasted: int = 1000) -> Scenario:
    """(e) Before turn `edit_at` the client rewrites an earlier long message (a ~`pasted`-token
    file the user pasted after turn 0) from its middle on: compaction of its second half into
    a short summary. The new prompt diverges ~`pasted`/2 tokens into that message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(rng, _n(scale, 300))},
                                      {"role": "user", "content": words(rng, _n(scale, 500))}]
    for t in range(turns):
        if t == edit_at:
            target = messages[3]  # system, user, assistant, *the pasted user message*
            kept = target["content"].split()
            target["content"] = " ".join(kept[: len(kept) // 2]) + " " + words(rng, _n(scale, 40))
        reply = yield _step(f"turn{t}" + ("-edited" if t >= edit_at else ""), messages)
        size = pasted if t == 0 else 300
        messages += [{"role": "assistant", "content": reply.text},
                     {"role": "user", "content": words(rng, _n(scale, size))}]


def interleaved(scale: float, rng: random.Random, conversations: int = 4,
                rounds: int = 4) -> Scenario:
    """(f) `conversations` chats of one agent (same system prompt) served round-robin, with a
    title and a summary side call after each round: more live sequences than 10 entries."""
    system = words(rng, _n(scale, 600))
    convs = [[{"role": "system", "content": system},
              {"role": "user", "content": words(rng, _n(scale, 400))}]
             for _ in range(conversations)]
    for r in range(rounds):
        for c, messages in enumerate(convs):
            reply = yield _step(f"r{r}c{c}", messages)
            messages += [{"role": "assistant", "content": reply.text},
                         {"role": "user", "content": words(rng, _n(scale, 200))}]
        first = convs[r % conversations][1]["content"]
        yield _step(f"r{r}title", [
            {"role": "system", "content": "write a short title for this request"},
            {"role": "user", "content": " ".join(first.split()[:60])}])
        yield _step(f"r{r}summary", [
            {"role": "system", "content": "write a summary of the conversation"},
            {"role": "user", "content": words(rng, _n(scale, 150))}])


def long_context(scale: float, rng: random.Random, target: int = 6500,
                 per_turn: int = 900) -> Scenario:
    """(g) A chat that grows past `target` tokens (past the sliding window many times)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(rng, _n(scale, 500))},
                                      {"role": "user", "content": words(rng, _n(scale, per_turn))}]
    total, t = _n(scale, 500) + _n(scale, per_turn), 0
    while True:
        reply = yield _step(f"turn{t}", messages)
        if total >= _n(scale, target):
            return
        user = _n(scale, per_turn)
        messages += [{"role": "assistant", "content": reply.text},
                     {"role": "user", "content": words(rng, user)}]
        total, t = total + user + 40, t + 1


def seeded_repeat(scale: float, rng: random.Random) -> Scenario:
    """(h) Exact repeats that carry a `seed` (stock mlx-lm serves these unbatched)."""
    return exact_repeat(scale, rng, seed=7, size=1500, repeats=3)


SCENARIOS: tuple[ScenarioSpec, ...] = (
    ScenarioSpec("a", "exact repeat, ~3,000 tokens", exact_repeat),
    ScenarioSpec("b", "6-turn append-only chat", chat),
    ScenarioSpec("c", "agent tool loop, 8 steps", tool_loop),
    ScenarioSpec("d", "reasoning stripped from history", thinking),
    ScenarioSpec("e", "earlier message edited mid-conversation", edit),
    ScenarioSpec("f", "4 interleaved chats + side calls", interleaved),
    ScenarioSpec("g", "chat past 6,000 tokens (sliding window)", long_context,
                 models=("gemma3_text",)),
    ScenarioSpec("h", "exact repeats with `seed`", seeded_repeat),
)
