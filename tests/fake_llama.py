"""A fake llama-server on a loopback port: slots, their prompt cache and its RAM prompt cache,
modelled on llama.cpp's server (`server_context::get_available_slot`, `server_prompt_cache`),
with words for tokens and sleeps for compute. The tests' and `bench/routing.py`'s outer
boundary where the real binary is not there.

What it models, as llama-server does:
- each slot holds one prompt (prompt + generated tokens); a request reuses the common prefix
  with its slot's prompt (all but the last token at most) and computes the rest;
- `id_slot` names the slot; a busy slot makes the request wait for it;
- otherwise the idle slot with the most similar prompt, if `similarity` > 0 and it exceeds
  it (similarity takeover), else the least recently used idle slot;
- the RAM prompt cache (`cache_ram_tokens`: a budget in tokens; 0 disables it, None is
  unlimited): when the server chose the slot by LRU (or a similarity pick keeps under half of
  the slot's prompt), the slot's prompt is saved and the saved prompt that best matches the
  request is restored into it; a named slot skips both; after each launch the idle slots
  are saved too (`cache_idle_slots`), and cleared if `kv_unified`;
- prompt processing is serialized (one compute device): `ms_per_token` per computed token.

It reports `usage.prompt_tokens_details.cached_tokens` and `timings.cache_n` like llama-server,
answers `/props` (`total_slots`, `default_generation_settings`, and `-sps`/`--cache-ram`
when `report_settings`), `/slots`, `/health` and `/v1/models`, and keeps a log of requests.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

_TOKEN = re.compile(r"\S+\s*|\s+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


def render(body: dict) -> str:
    """A ChatML-like rendering of a chat (or the completions prompt as it is)."""
    if "prompt" in body:
        return str(body["prompt"])
    out = []
    for m in body.get("messages") or []:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append(f"<|im_start|>{m.get('role')}\n{content or ''}<|im_end|>\n")
    return "".join(out) + "<|im_start|>assistant\n"


def lcp(a: list[str], b: list[str]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class Slot:
    id: int
    tokens: list[str] = field(default_factory=list)
    busy: bool = False
    t_last_used: float = -1.0
    id_task: int | None = None
    n_cached: int = 0
    n_processed: int = 0
    seed: int = -1


@dataclass
class Served:
    """One request as the server handled it."""

    id_slot: int            # as sent (-1: none)
    slot: int               # where it ran
    prompt: int
    cached: int
    restored: bool          # its slot was refilled from the RAM cache


class FakeLlama:
    def __init__(self, slots: int = 1, similarity: float = 0.0,
                 cache_ram_tokens: int | None = None, cache_idle_slots: bool = True,
                 kv_unified: bool = False, n_ctx: int = 16384, ms_per_token: float = 0.0,
                 reply_tokens: int = 8, report_settings: bool = True) -> None:
        self.slots = [Slot(i) for i in range(slots)]
        self.similarity, self.cache_ram_tokens = similarity, cache_ram_tokens
        self.cache_idle_slots, self.kv_unified = cache_idle_slots, kv_unified
        self.n_ctx, self.ms_per_token, self.reply_tokens = n_ctx, ms_per_token, reply_tokens
        self.report_settings = report_settings
        self.ram: list[list[str]] = []          # saved prompts, oldest first
        self.served: list[Served] = []
        self.received: list[dict[str, Any]] = []
        self._changed = asyncio.Condition()
        self._compute = asyncio.Lock()
        self._tasks = 0
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/props", self._props)
        app.router.add_get("/slots", self._slots)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # --- the model of llama-server's slot placement -------------------------------------

    def _ram_on(self) -> bool:
        return self.cache_ram_tokens != 0

    def _select(self, tokens: list[str], id_slot: int) -> tuple[Slot | None, bool]:
        """get_available_slot: (slot or None, whether the RAM cache is updated)."""
        ret = self.slots[id_slot % len(self.slots)] if id_slot != -1 else None
        update = False
        if self.similarity != 0:
            best = 0.0
            for s in self.slots:
                if (id_slot != -1 and s.id != id_slot) or s.busy or not s.tokens:
                    continue
                sim = lcp(s.tokens, tokens) / len(tokens)
                if sim > best and sim > self.similarity:
                    best, ret = sim, s
            if ret is not None:
                keep = best * len(tokens) / len(ret.tokens) if ret.tokens else math.nan
                update = keep < 0.5
        if ret is None:
            for s in self.slots:
                if not s.busy and (ret is None or s.t_last_used <= ret.t_last_used):
                    ret = s
            update = ret is not None
        return ret, update and self._ram_on()

    def _save(self, slot: Slot) -> None:
        """server_prompt_cache::alloc for the slot's prompt."""
        p = slot.tokens
        if not p or any(lcp(e, p) == len(p) for e in self.ram):
            return
        limit = self.cache_ram_tokens
        if limit is not None and len(p) > limit:
            return
        self.ram = [e for e in self.ram if lcp(e, p) != len(e)]
        while limit is not None and self.ram and sum(map(len, self.ram)) + len(p) > limit:
            self.ram.pop(0)
        self.ram.append(list(p))

    def _load(self, slot: Slot, new: list[str]) -> bool:
        """server_prompt_cache::load: the saved prompt that keeps more and matches more."""
        base = lcp(slot.tokens, new)
        keep_best = base / len(slot.tokens) if slot.tokens else -1.0
        sim_best, best = base / len(new), None
        for i, e in enumerate(self.ram):
            n = lcp(e, new)
            keep, sim = n / len(e), n / len(new)
            if keep < 0.25:
                continue
            if keep_best < keep and sim_best < sim:
                keep_best, sim_best, best = keep, sim, i
        if best is None:
            return False
        slot.tokens = self.ram.pop(best)
        return True

    async def _acquire(self, tokens: list[str], id_slot: int) -> tuple[Slot, bool]:
        async with self._changed:
            while True:
                slot, update = self._select(tokens, id_slot)
                if slot is not None and not slot.busy:
                    break
                await self._changed.wait()       # deferred until a slot is released
            restored = False
            if update:
                self._save(slot)
                restored = self._load(slot, tokens)
            slot.busy = True
            if self.cache_idle_slots and self._ram_on():
                for s in self.slots:
                    if not s.busy:
                        self._save(s)
                        if self.kv_unified:
                            s.tokens = []
            return slot, restored

    async def _release(self, slot: Slot) -> None:
        async with self._changed:
            slot.busy = False
            slot.n_cached = slot.n_processed = 0      # llama-server resets a slot's stats
            slot.t_last_used = time.monotonic()
            self._changed.notify_all()

    # --- HTTP ---------------------------------------------------------------------------

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        tokens = tokenize(render(body))
        if not tokens:
            return web.json_response({"error": {"message": "empty prompt", "code": 400}},
                                     status=400)
        if len(tokens) > self.n_ctx:
            return web.json_response({"error": {"message": "exceed_context_size_error",
                                                "code": 400}}, status=400)
        id_slot = body.get("id_slot", -1)
        id_slot = id_slot if isinstance(id_slot, int) else -1
        slot, restored = await self._acquire(tokens, id_slot)
        try:
            self._tasks += 1
            cached = lcp(slot.tokens, tokens)
            if cached == len(tokens):
                cached -= 1                          # the last token is always evaluated
            processed = len(tokens) - cached
            async with self._compute:                # waiting for it is not prompt time
                t0 = time.monotonic()
                await asyncio.sleep(processed * self.ms_per_token / 1000)
                prompt_ms = (time.monotonic() - t0) * 1000
            reply = " ".join(f"w{(len(tokens) * 7 + i) % 97}" for i in range(self.reply_tokens))
            slot.tokens = tokens + tokenize(reply)
            slot.id_task, slot.n_cached, slot.n_processed = self._tasks, cached, processed
            seed = body.get("seed")
            slot.seed = seed if isinstance(seed, int) else 0xFFFFFFFF
            self.served.append(Served(id_slot, slot.id, len(tokens), cached, restored))
            usage = {"prompt_tokens": len(tokens), "completion_tokens": self.reply_tokens,
                     "total_tokens": len(tokens) + self.reply_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            timings = {"cache_n": cached, "prompt_n": processed, "prompt_ms": prompt_ms,
                       "predicted_n": self.reply_tokens}
            if body.get("stream"):
                return await self._stream(request, body, reply, usage, timings)
            return web.json_response({
                "id": f"chatcmpl-{self._tasks}", "object": "chat.completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": reply}}],
                "usage": usage, "timings": timings})
        finally:
            await self._release(slot)

    async def _stream(self, request: web.Request, body: dict, reply: str, usage: dict,
                      timings: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(obj: dict) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        head = {"id": f"chatcmpl-{self._tasks}", "object": "chat.completion.chunk",
                "model": body.get("model")}
        await event({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": reply}}]})
        await event({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                     "timings": timings})
        if (body.get("stream_options") or {}).get("include_usage"):
            await event({**head, "choices": [], "usage": usage, "timings": timings})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-llama"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _props(self, request: web.Request) -> web.Response:
        props: dict[str, Any] = {
            "total_slots": len(self.slots), "build_info": "fake-llama",
            "default_generation_settings": {"n_ctx": self.n_ctx, "params": {}}}
        if self.report_settings:
            props["slot_prompt_similarity"] = self.similarity
            limit = self.cache_ram_tokens      # reported at 16 tokens per MiB
            props["cache_ram_mib"] = -1 if limit is None else -(-limit // 16)
        return web.json_response(props)

    async def _slots(self, request: web.Request) -> web.Response:
        out = []
        for s in self.slots:
            d: dict[str, Any] = {"id": s.id, "n_ctx": self.n_ctx, "speculative": False,
                                 "is_processing": s.busy}
            if s.id_task is not None:
                d.update(id_task=s.id_task, n_prompt_tokens=len(s.tokens),
                         n_prompt_tokens_processed=s.n_processed,
                         n_prompt_tokens_cache=s.n_cached, params={"seed": s.seed})
            out.append(d)
        return web.json_response(out)
