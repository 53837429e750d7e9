"""Calls to a prefixd worker's own endpoints (`/tokenize`, `/metrics`, `/v1/cache`, and the
state export/import that moves a prefix between workers) over a `WorkerLink`, shared by the
managed backend (a local worker it runs) and the `prefixd` backend (a remote one). Every call
is bounded in time and answers None (or a `Moved` outcome) when the worker cannot tell."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from prefixd.api.values import count
from prefixd.backends.base import WorkerLink
from prefixd.backends.mlx.server import seal


async def worker_call(link: WorkerLink | None, path: str, payload: dict | None = None,
                      text: bool = False, timeout_s: float = 10.0) -> Any:
    """GET (or POST `payload` to) a worker's `path`: its JSON (or text); None when the worker
    is not reachable now or cannot tell."""
    return None if link is None else await call(link.session, link.base + path, link.auth,
                                                payload, text, timeout_s)


async def tokenize(link: WorkerLink | None, body: dict) -> list[int] | None:
    """The worker's exact prompt ids for a chat or completions body (rendered through its
    chat template, no boundaries), for exact prefix-report offsets; None when it cannot
    tell now."""
    return token_ids(await worker_call(link, "/tokenize", tokenize_payload(body)))


async def metrics_text(link: WorkerLink | None) -> str | None:
    """The worker's own /metrics (its prompt cache), or None when it cannot answer."""
    return await worker_call(link, "/metrics", text=True)


async def cache_info(link: WorkerLink | None) -> dict | None:
    """The worker's /v1/cache (its checkpoint store and disk tier), or None."""
    answer = await worker_call(link, "/v1/cache")
    return answer if isinstance(answer, dict) else None


class WindowMemo:
    """A worker's context window (`context_length` of its `/v1/models`), asked once per
    worker generation; the last one learned is kept while no worker answers (a model's window
    does not change between its workers)."""

    def __init__(self) -> None:
        self._seen: tuple[int, int | None] | None = None    # (generation, window)

    async def get(self, link: WorkerLink | None, generation: int) -> int | None:
        if self._seen is not None and (self._seen[0] == generation or link is None):
            return self._seen[1]
        if link is None:
            return None
        answer = await worker_call(link, "/v1/models", timeout_s=2.0)
        if answer is None:
            return self._seen[1] if self._seen is not None else None
        self._seen = (generation, context_length(answer))
        return self._seen[1]


def context_length(answer: Any) -> int | None:
    """The `context_length` of a worker's (one) model in its `/v1/models` answer."""
    data = answer.get("data") if isinstance(answer, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    value = count(first.get("context_length")) if isinstance(first, dict) else None
    return value or None


def tokenize_payload(body: dict[str, Any]) -> dict[str, Any]:
    """A chat or completions body as a `/tokenize` request: ids only, no boundaries."""
    if isinstance(body.get("prompt"), str):
        return {"content": body["prompt"]}
    return {**body, "boundaries": False}


def token_ids(answer: Any) -> list[int] | None:
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    return tokens if isinstance(tokens, list) else None


async def call(session: aiohttp.ClientSession, url: str, auth: dict[str, str],
               payload: dict[str, Any] | None = None, text: bool = False,
               timeout_s: float = 10.0) -> Any:
    """GET (or POST `payload` to) `url`: its JSON (or text), None on any failure."""
    method = session.get if payload is None else session.post
    try:
        async with method(url, json=payload, headers=auth,
                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return None
            return await r.text() if text else await r.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None


@dataclass(frozen=True)
class Moved:
    """How a state move ended: `moved` (the target stored `tokens`), `not_cached` (the source
    holds no prefix of the prompt), `refused` (the target would not store it: another model's,
    too large, not signed with its transfer secret, its budget), `timeout`, or `error` (a
    worker unreachable or failing)."""

    outcome: str
    tokens: int = 0
    nbytes: int = 0
    detail: str = ""
    status: int = 0          # the refusal (409: another model's state; 403: not signed with
                             # the target's transfer secret)


async def move_state(src: WorkerLink | None, dst: WorkerLink | None, body: bytes,
                     timeout_s: float, extra: dict[str, str] | None = None) -> Moved:
    """Copy the longest prefix of `body`'s prompt that `source` restores into `target`'s
    prompt cache, streamed from one worker to the other (never held whole here), with the MAC
    the source signed it with (`seal.py`; the target checks it: the proxy holds no secret). An
    unsigned export is not sent. The export runs on the source's generation thread after its
    request in progress, so this waits for a prefix the source is computing; `timeout_s`
    bounds the whole move. `extra`: headers for both ends (the request's cache partition)."""
    if src is None or dst is None:
        return Moved("error", detail="a worker is not running")
    sent = 0

    async def counted(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        nonlocal sent
        async for chunk in chunks:
            sent += len(chunk)
            yield chunk

    try:
        async with asyncio.timeout(timeout_s):
            async with src.session.post(src.base + "/v1/cache/export", data=body,
                                        headers={**src.auth, **(extra or {}),
                                                 "Content-Type": "application/json"}) as r:
                if r.status == 404:
                    return Moved("not_cached")
                if r.status != 200:
                    return Moved("error", detail=f"export answered {r.status}")
                mac = r.headers.get(seal.HEADER)
                if mac is None:
                    return Moved("refused", detail="the source signs no bundles (it has no "
                                 "transfer secret)", status=403)
                headers = {**dst.auth, **(extra or {}),
                           "Content-Type": "application/octet-stream", seal.HEADER: mac}
                if r.content_length is not None:
                    headers["Content-Length"] = str(r.content_length)
                async with dst.session.post(dst.base + "/v1/cache/import", headers=headers,
                                            data=counted(r.content.iter_chunked(1 << 20))) as t:
                    answer = await t.json(content_type=None) if t.status == 200 else None
                    if t.status != 200:
                        return Moved("refused", 0, sent, (await t.text())[:300], t.status)
    except TimeoutError:
        return Moved("timeout", 0, sent)
    except (aiohttp.ClientError, OSError, ValueError) as e:
        return Moved("error", 0, sent, str(e) or type(e).__name__)
    tokens = count(answer.get("tokens")) if isinstance(answer, dict) else None
    if tokens is None:
        return Moved("error", 0, sent, "the import answered no token count")
    return Moved("moved" if tokens else "refused", tokens, sent,
                 "" if tokens else "the target's budget did not take it")
