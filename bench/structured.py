"""Decode speed with structured output against without (docs/BENCHMARKS.md "Structured output").

    ./run bench structured                              # built-in SmolLM2-135M, 3 repeats
    ./run bench structured --model /path/to/mlx/model --repeats 5

The real worker app in-process (one Generator, as `prefixd worker` runs it) answers the same
conversations streamed: free text, `response_format` json_schema, json_object, and a required
tool call. Decode tokens/s of one answer = (completion tokens - 1) / (last chunk - first
chunk), so prefill and the grammar's compile time are left out (the first token pays both);
the table gives the median over answers and its ratio to free text (target >= 0.9x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server.app import create_app
from prefixd.proxy.settings import Settings

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60},
    "summary": {"type": "string", "maxLength": 400},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    "priority": {"enum": ["low", "medium", "high"]},
    "estimate_hours": {"type": "number"}, "done": {"type": "boolean"}},
    "required": ["title", "summary", "tags", "priority", "estimate_hours", "done"],
    "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "create_ticket", "parameters": SCHEMA}}
PROMPTS = ["Describe a bug ticket for a login page that crashes on submit.",
           "Write up a task to migrate the billing database to Postgres 17.",
           "Summarize a feature request for dark mode in the settings page."]
MODES: dict[str, dict[str, Any]] = {
    "free text": {},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "ticket", "schema": SCHEMA, "strict": True}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "tool_choice required": {"tools": [TOOL], "tool_choice": "required"},
}


async def one(client: TestClient, prompt: str, extra: dict[str, Any], max_tokens: int
              ) -> tuple[int, float]:
    body = {"model": "m", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "Answer in JSON when asked."},
                         {"role": "user", "content": prompt}], **extra}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    first = last = 0.0
    tokens = 0
    async for line in resp.content:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        now = time.perf_counter()
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif chunk["choices"] and chunk["choices"][0]["delta"].keys() - {"role"}:
            first = first or now
            last = now
    return tokens, (last - first)


async def run(model: str, repeats: int, max_tokens: int) -> dict[str, list[float]]:
    settings = Settings(_env_file=None, max_tokens_default=max_tokens)
    gen = Generator(settings)
    await gen.load(model)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        async with TestClient(TestServer(create_app(gen, "m", settings))) as client:
            await one(client, PROMPTS[0], {}, 8)  # warm-up
            for _ in range(repeats):
                for prompt in PROMPTS:
                    for mode, extra in MODES.items():
                        n, seconds = await one(client, prompt, extra, max_tokens)
                        if n > 1 and seconds > 0:
                            rates[mode].append((n - 1) / seconds)
    finally:
        gen.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    rates = asyncio.run(run(args.model, args.repeats, args.max_tokens))
    base = statistics.median(rates["free text"])
    print(f"model {args.model}, {args.repeats} x {len(PROMPTS)} answers per mode, "
          f"max_tokens {args.max_tokens}\n")
    print("| mode | answers | decode tok/s (median) | vs free text |")
    print("|---|---|---|---|")
    for mode, values in rates.items():
        med = statistics.median(values)
        print(f"| {mode} | {len(values)} | {med:.1f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
