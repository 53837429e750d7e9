"""Only a request a backend accepted is a turn (issue 33 item 1): a request refused before a
backend answers 200 (its window, a full queue, the backend's own 4xx) is never part of its
lane's history and teaches the lane nothing; the next request is compared with the last one
served, and the refusal's own `X-Prefixd-Prefix` says it reused nothing (`served=0`).

Found with Claude Code at a 16K window: a 400 `prompt is too long` became turn 3 of the main
lane, and the compaction request after it was reported as a BRANCH against that refused
prompt (an APPEND against the last one served)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from fake_upstream import FakeUpstream
from proxy_fixtures import StartProxy

SYSTEM = "You are a careful coding agent. Follow the repository's conventions."
SESSION = {"X-Session-Id": "agent-1"}


def conversation(*users: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(users):
        if i:
            messages.append({"role": "assistant", "content": "ok"})
        messages.append({"role": "user", "content": text})
    return messages


async def post(http: aiohttp.ClientSession, port: int, messages: list[dict[str, Any]],
               **extra: Any) -> tuple[int, str]:
    body = {"model": "fake", "messages": messages,       # the answer the next turn echoes
            "fake": {"reply": {"content": "ok"}}, **extra}
    async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                         headers=SESSION) as r:
        await r.read()
        return r.status, r.headers.get("X-Prefixd-Prefix", "")


async def lane_view(http: aiohttp.ClientSession, port: int) -> tuple[list[dict], list[dict]]:
    """Every lane, and the reports of the conversation's first lane."""
    async with http.get(f"http://127.0.0.1:{port}/debug/prefix") as r:
        lanes = (await r.json())["lanes"]
    async with http.get(f"http://127.0.0.1:{port}/debug/prefix/s:agent-1") as r:
        return lanes, (await r.json())["reports"]


async def test_a_request_over_the_window_is_not_a_turn(
        upstream: FakeUpstream, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy(upstream.url, backend={"context_window": 2000})
    first = conversation("Read the file main.py and tell me what it does.")
    assert (await post(http, proxy.port, first))[0] == 200
    second = conversation(first[1]["content"], "Now list its functions.")
    assert (await post(http, proxy.port, second))[0] == 200
    # the agent pastes a huge tool result: over the window, refused before the upstream
    huge = conversation(first[1]["content"], "Now list its functions.", "x " * 20000)
    status, header = await post(http, proxy.port, huge)
    assert status == 400
    assert "served=0" in header and "reused=" not in header
    assert len(upstream.received) == 2
    # the compaction request: the conversation served so far, plus a summary request. It
    # continues turn 2 (an APPEND), and is the lane's third turn.
    compact = conversation(first[1]["content"], "Now list its functions.",
                           "Summarize the conversation so far.")
    status, header = await post(http, proxy.port, compact)
    assert status == 200
    assert header.startswith("verdict=APPEND;"), header
    lanes, reports = await lane_view(http, proxy.port)
    assert [r["turn"] for r in reports] == [1, 2, 3]
    assert [r["verdict"] for r in reports] == ["NEW", "APPEND", "APPEND"]
    assert [(x["lane"], x["turn"], x["unserved"]) for x in lanes] == [("s:agent-1", 3, 1)]


async def test_a_backends_own_refusal_and_a_full_queue_are_not_turns(
        upstream: FakeUpstream, start_proxy: StartProxy, http: aiohttp.ClientSession) -> None:
    proxy = await start_proxy(upstream.url, backend={"max_concurrency": 1, "queue_depth": 0})
    first = conversation("What does this repository do?")
    assert (await post(http, proxy.port, first))[0] == 200
    # the backend refuses it itself (a schema it cannot serve, say): its 400 passes through
    edited = conversation("What does this repository do? Answer in French.", "And its tests?")
    status, header = await post(http, proxy.port, edited, fake={"status": 400})
    assert status == 400 and "served=0" in header, header
    # the backend's only slot is held and nothing may wait: a 429 before the upstream
    held = asyncio.create_task(post(http, proxy.port, conversation("Another conversation."),
                                    fake={"hold": True}))
    await upstream.wait_received(3)
    status, header = await post(http, proxy.port, edited)
    assert status == 429 and "served=0" in header, (status, header)
    upstream.release.set()
    assert (await held)[0] == 200
    # the next turn continues the first one, not the edited prompt the refusals carried
    status, header = await post(http, proxy.port, conversation(first[1]["content"], "And?"))
    assert status == 200 and header.startswith("verdict=APPEND;"), header
    lanes, reports = await lane_view(http, proxy.port)
    assert [(r["turn"], r["verdict"]) for r in reports] == [(1, "NEW"), (2, "APPEND")]
    # the held conversation has a lane of its own (one served turn); the two refusals are
    # counted, never turns
    assert sorted(x["turn"] for x in lanes) == [1, 2]
    assert sum(x["unserved"] for x in lanes) == 2
