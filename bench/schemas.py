"""Real-world JSON schemas through structured output: how many are accepted, how many answers
finish within a modest `max_tokens`, and whether every finished answer validates
(docs/CLIENTS.md "Structured output").

    ./run bench schemas --schemas DIR [DIR ...] --per-dir 8 --max-tokens 96
    ./run bench schemas --schemas ~/jsonschemabench/data/{Github_easy,Kubernetes,Glaiveai2K}

Each DIR holds one schema per `*.json` file (e.g. the folders of the public JSON-schema
benchmark: GitHub, Kubernetes, JsonSchemaStore, Glaiveai2K function calling, ...); `--per-dir`
of them are taken, evenly spread over the sorted names. The real worker app in-process (the
built-in SmolLM2-135M by default) answers each schema twice, greedy: as `response_format`
json_schema (strict) and as the parameters of a forced tool call. Per answer: the HTTP status
(no 5xx expected), `finish_reason` (`stop` / `tool_calls`: finished; `length`: cut), whether a
finished answer validates (`jsonschema`, if installed), and the proxy's compile-check time.
Writes bench/out/schemas.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from prefixd.api.errors import ApiError
from prefixd.api.structured import check, constraint
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server.app import create_app
from prefixd.proxy.settings import Settings

OUT = Path(__file__).parent / "out"
PROMPT_CHARS = 1500     # a longer schema is not shown in the prompt (the grammar has it)


def pick(dirs: list[Path], per_dir: int) -> list[Path]:
    chosen: list[Path] = []
    for d in dirs:
        files = sorted(d.glob("*.json"))
        step = max(1, len(files) // per_dir)
        chosen += files[::step][:per_dir]
    return chosen


def valid(value: Any, schema: dict[str, Any]) -> bool | None:
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:
        return None
    return True


def request(schema: dict[str, Any], mode: str, max_tokens: int) -> dict[str, Any]:
    text = json.dumps(schema)
    shown = f"\n\nThe JSON schema:\n{text}" if len(text) <= PROMPT_CHARS else ""
    body: dict[str, Any] = {
        "model": "m", "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": "Write a realistic example instance as JSON."
                                                 + shown}]}
    if mode == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "example", "schema": schema, "strict": True}}
    else:
        body["tools"] = [{"type": "function", "function": {"name": "example",
                                                           "parameters": schema}}]
        body["tool_choice"] = "required"
    return body


def compile_ms(body: dict[str, Any]) -> tuple[float, str | None]:
    """The proxy's check of `body` (ms), and its 400 message if it refuses."""
    t0 = time.perf_counter()
    try:
        check(constraint(body.get("response_format"), body.get("tools"),
                         body.get("tool_choice"), None))
    except ApiError as e:
        return 1000 * (time.perf_counter() - t0), e.message
    return 1000 * (time.perf_counter() - t0), None


async def one(client: TestClient, path: Path, schema: dict[str, Any], mode: str,
              max_tokens: int) -> dict[str, Any]:
    body = request(schema, mode, max_tokens)
    ms, refusal = compile_ms(body)
    row: dict[str, Any] = {"schema": f"{path.parent.name}/{path.name}", "mode": mode,
                           "check_ms": round(ms, 2), "refusal": refusal}
    t0 = time.perf_counter()
    resp = await client.post("/v1/chat/completions", json=body)
    row["status"] = resp.status
    out = await resp.json()
    row["seconds"] = round(time.perf_counter() - t0, 2)
    if resp.status != 200:
        row["error"] = out["error"]["message"][:200]
        return row
    choice = out["choices"][0]
    row["finish"], row["tokens"] = choice["finish_reason"], out["usage"]["completion_tokens"]
    message = choice["message"]
    row["leak"] = "<tool_call>" in (message.get("content") or "")
    row["text"] = (message.get("content") or json.dumps(message.get("tool_calls")))[:400]
    if row["finish"] in ("stop", "tool_calls"):
        calls = message.get("tool_calls") or []
        text = calls[0]["function"]["arguments"] if calls else message.get("content") or ""
        try:
            row["valid"] = valid(json.loads(text), schema)
        except json.JSONDecodeError:
            row["valid"] = False
    return row


async def run(model: str, files: list[Path], max_tokens: int) -> list[dict[str, Any]]:
    settings = Settings(_env_file=None)
    gen = Generator(settings)
    await gen.load(model)
    rows: list[dict[str, Any]] = []
    try:
        async with TestClient(TestServer(create_app(gen, "m", settings))) as client:
            for path in files:
                schema = json.loads(path.read_text())
                for mode in ("json_schema", "tool"):
                    rows.append(await one(client, path, schema, mode, max_tokens))
                    r = rows[-1]
                    print(f"{r['schema']:40} {mode:11} {r['status']} {r.get('finish', '-'):10}"
                          f" {r.get('tokens', '-'):>4} {r['seconds']:5.1f}s "
                          f"valid={r.get('valid', '-')} check={r['check_ms']:.1f}ms "
                          f"{r.get('error', '')[:80]}", flush=True)
    finally:
        gen.close()
    return rows


def summary(rows: list[dict[str, Any]], max_tokens: int) -> str:
    lines = [f"max_tokens {max_tokens}, {len(rows) // 2} schemas", "",
             "| mode | answers | 200 | 4xx | 5xx | finished | finished valid | cut (length) |"
             " markup leaked |", "|---|---|---|---|---|---|---|---|---|"]
    for mode in ("json_schema", "tool"):
        mine = [r for r in rows if r["mode"] == mode]
        status = Counter(r["status"] // 100 for r in mine)
        done = [r for r in mine if r.get("finish") in ("stop", "tool_calls")]
        lines.append(f"| {mode} | {len(mine)} | {status[2]} | {status[4]} | {status[5]} | "
                     f"{len(done)} | {sum(r.get('valid') is True for r in done)} | "
                     f"{sum(r.get('finish') == 'length' for r in mine)} | "
                     f"{sum(bool(r.get('leak')) for r in mine)} |")
    checks = sorted(r["check_ms"] for r in rows)
    lines += ["", f"proxy compile check: median {statistics.median(checks):.2f} ms, "
              f"max {checks[-1]:.1f} ms"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--schemas", nargs="+", type=Path, required=True)
    parser.add_argument("--per-dir", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    rows = asyncio.run(run(args.model, pick(args.schemas, args.per_dir), args.max_tokens))
    OUT.mkdir(exist_ok=True)
    (OUT / "schemas.json").write_text(json.dumps(rows, indent=1))
    print(summary(rows, args.max_tokens))


if __name__ == "__main__":
    main()
