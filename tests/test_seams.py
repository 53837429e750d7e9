"""The seams a code review found (issue 24): one parsed `usage` that every reader agrees on,
one routing view per request, counting tokens is not routing, backends asked through their
typed contract (never by kind)."""

from __future__ import annotations

import ast
import json
import logging
import time
from dataclasses import fields
from pathlib import Path

import pytest

from prefixd.api.usage import Usage
from prefixd.api.values import count
from prefixd.backends.base import Backend, Capabilities
from prefixd.metrics import REGISTRY
from prefixd.proxy.routing.index import PrefixIndex, boundaries

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
SYSTEM = "You are a careful assistant working in a large repository. " * 20


def turn(n: int, usage: dict | None = None) -> dict:
    msgs: list[dict] = [{"role": "system", "content": SYSTEM}]
    for i in range(n):
        msgs += [{"role": "user", "content": f"question {i} " * 20},
                 {"role": "assistant", "content": "hello"}]
    msgs.append({"role": "user", "content": f"question {n} " * 20})
    return {"model": "fake", "messages": msgs, "fake": {"usage": usage or {}}}


@pytest.mark.parametrize("value", [True, False, -3, 2.5, 2**41, None])
def test_a_count_is_an_integer_in_range_and_nothing_else(value: object) -> None:
    assert count(value) is None
    parsed = Usage.parse({"prompt_tokens": value, "completion_tokens": value,
                          "prompt_tokens_details": {"cached_tokens": value}})
    assert parsed == Usage(None, None, None)


def test_usage_keeps_real_counts_and_the_workers_breakdown() -> None:
    worker = {"cache": {"hit_tokens": 7}}
    parsed = Usage.parse({"prompt_tokens": 12, "completion_tokens": 0,
                          "prompt_tokens_details": {"cached_tokens": 7}}, worker)
    assert parsed == Usage(12, 0, 7, worker)
    assert Usage.parse("not an object") is None and Usage.parse({}) == Usage()


@pytest.mark.parametrize("odd", [True, -3, 2.5])
async def test_an_odd_cached_count_is_not_reported_by_anyone(odd, upstream, start_proxy, http,
                                                             caplog):
    """An upstream reporting `cached_tokens` as true, negative or fractional: the request log,
    the metrics, the prefix report and routing all read it as not reported (they used to
    disagree: the log and the report took `true` as 1 and -3 as -3)."""
    caplog.set_level(logging.INFO, logger="prefixd.request")
    proxy = await start_proxy(upstream.url)
    before = REGISTRY.get_sample_value("prefixd_cached_prompt_tokens_total",
                                       {"backend": "up", "model": "fake"}) or 0.0
    for n in range(2):
        async with http.post(f"http://127.0.0.1:{proxy.port}{CHAT}",
                             json=turn(n, {"cached_tokens": odd, "prompt_tokens": 300})) as r:
            assert r.status == 200
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    assert len(lines) == 2 and all("cached_tokens=" not in line for line in lines), lines
    assert all("prompt_tokens=300" in line for line in lines)
    after = REGISTRY.get_sample_value("prefixd_cached_prompt_tokens_total",
                                      {"backend": "up", "model": "fake"}) or 0.0
    assert after == before
    async with http.get(f"http://127.0.0.1:{proxy.port}/debug/prefix") as r:
        lane = (await r.json())["lanes"][0]["lane"]
    async with http.get(f"http://127.0.0.1:{proxy.port}/debug/prefix/{lane}") as r:
        reports = (await r.json())["reports"]
    assert [rep["backend_cached_tokens"] for rep in reports] == [None, None]
    assert proxy.proxy.router.truth["up"]["reported_tokens"] == 0


async def test_count_tokens_is_not_a_routing_decision(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)

    def decisions() -> float:
        return sum(s.value for metric in REGISTRY.collect()
                   if metric.name == "prefixd_route_decisions"
                   for s in metric.samples if s.name.endswith("_total"))

    before = decisions()
    body = {"model": "fake", "messages": [{"role": "user", "content": "count me " * 40}]}
    for _ in range(3):
        async with http.post(f"http://127.0.0.1:{proxy.port}/v1/messages/count_tokens",
                             json=body) as r:
            assert r.status == 200 and (await r.json())["input_tokens"] > 0
    assert decisions() == before
    async with http.post(f"http://127.0.0.1:{proxy.port}{CHAT}", json=turn(0)) as r:
        assert r.status == 200
    assert decisions() == before + 1


class CountingIndex(PrefixIndex):
    """The real index, counting how often a request's chain is looked up."""

    lookups = 0

    def longest(self, chain, now):  # type: ignore[no-untyped-def]
        self.lookups += 1
        return super().longest(chain, now)


async def test_a_request_reads_the_prefix_index_once(upstream, start_proxy, http):
    """Two prefixd workers of one model with transfers on: deciding the backend and planning
    a transfer read one routing view (the index was read per step: twice, or three times)."""
    backends = [{"name": n, "kind": "prefixd", "url": upstream.url, "models": ["fake"]}
                for n in ("w1", "w2")]
    proxy = await start_proxy(backends=backends)
    index = proxy.proxy.router.prefixes = CountingIndex()
    for n in range(3):
        async with http.post(f"http://127.0.0.1:{proxy.port}{CHAT}", json=turn(n)) as r:
            assert r.status == 200
    assert index.lookups == 3
    assert index.size("w1") + index.size("w2") > 0      # it was read and written for real


KINDS = {"prefixd.backends.managed", "prefixd.backends.openai", "prefixd.backends.remote"}
# what a backend may have: its contract's members and capabilities, and the flags of old
CONTRACT = ({n for n in dir(Backend) if not n.startswith("_")}
            | {f.name for f in fields(Capabilities)} | {"moves_state", "restarts_itself"})


def test_the_proxy_asks_backends_through_their_contract() -> None:
    """No module of the proxy names a backend kind (only `registry` builds them) or probes
    a backend for an attribute: capabilities and facets are typed (`backends/base.py`)."""
    found = []
    for path in sorted((ROOT / "proxy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module in KINDS:
                found.append(f"{path.name} imports {node.module}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "hasattr") and len(node.args) > 1 and \
                    isinstance(node.args[1], ast.Constant) and node.args[1].value in CONTRACT:
                found.append(f"{path.name}: {ast.unparse(node)}")
    assert found == []


async def test_predicted_never_exceeds_the_prompt(upstream, start_proxy, http):
    """An index entry recorded larger than this request's prompt (an earlier render of it: a
    reply re-rendered shorter, a stored reply's own tokens) predicts at most the prompt."""
    proxy = await start_proxy(upstream.url)
    url = f"http://127.0.0.1:{proxy.port}{CHAT}"
    body = turn(0, {"prompt_tokens": 300})
    async with http.post(url, json=body) as r:
        assert r.status == 200
    router = proxy.proxy.router
    chain = boundaries(router_segments(proxy, body))
    router.prefixes.record("up", chain, time.monotonic(), exact_tokens=100_000)
    async with http.post(url, json=body) as r:
        header = r.headers["X-Prefixd-Prefix"]
    predicted = int(header.split("predicted=")[1].split(";")[0])
    assert 0 < predicted <= 300, header


def router_segments(proxy, body: dict) -> list:
    from prefixd.proxy.prefix.segments import flatten

    return flatten({k: v for k, v in body.items() if k != "fake"})


async def test_message_start_states_the_prompts_size(upstream, start_proxy, http):
    """A Messages stream's `message_start` states the prompt's input tokens as prefixd counted
    them before sending (it said 0): an estimate at first, the backend's own count once its
    scale is learned."""
    proxy = await start_proxy(upstream.url)
    body = {"model": "fake", "stream": True, "max_tokens": 50, "system": SYSTEM,
            "messages": [{"role": "user", "content": "question " * 40}]}
    starts = []
    for _ in range(2):
        upstream.scripted.append({"usage": {"prompt_tokens": 777, "cached_tokens": 0}})
        async with http.post(f"http://127.0.0.1:{proxy.port}/v1/messages", json=body) as r:
            raw = (await r.read()).decode()
        start = next(line for line in raw.splitlines()
                     if line.startswith("data:") and '"message_start"' in line)
        starts.append(json.loads(start[5:])["message"]["usage"]["input_tokens"])
    assert 200 < starts[0] < 2000, starts          # ~ the characters / 4
    assert starts[1] == 777, starts                 # the backend's count, learned
