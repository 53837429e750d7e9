"""A worker's KV events are honest: real in-process workers (the Generator behind the real app)
publish on loopback ports, a subscriber decodes the stream as vLLM's consumers do
(`kvevents.subscriber.Feed` into a token-level `Held`), and before each request, once the feed
applied every batch published so far, what it credits the prompt is what the worker then
reports it restored (`usage.prompt_tokens_details.cached_tokens`):

- on the five tiny architectures (plain KV, Gated-DeltaNet and Mamba2 hybrids, sliding
  windows): follow-up turns, a second conversation sharing the system prompt, turns edited
  inside the conversation; exact, but for plain KV restored inside a block (a trimmable state
  restores any prefix; a block holds 16 tokens): then under by less than a block, never over;
- RAM evictions announced (BlockRemoved): a conversation the budget dropped is credited what
  the worker still restores of it;
- the disk tier (medium DISK): a state evicted from RAM but written stays credited, and a
  follow-up restored from disk is credited what it restored;
- the stream's life: AllBlocksCleared first (sequence 0) and at close, the counts in
  /v1/cache, the positional (array) encoding on the wire;
- a managed backend's worker gets its own stream's endpoints, never the proxy's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer
from worker_process import free_port

from prefixd.api.schema import NAMESPACE_HEADER
from prefixd.backends.config import BackendConfig
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.server.app import create_app
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.backends.supervision.process import worker_env
from prefixd.kvevents.index import Held
from prefixd.kvevents.prefix import CHUNK
from prefixd.kvevents.subscriber import Feed
from prefixd.kvevents.wire import (
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    decode,
    seq_bytes,
    seq_of,
)
from prefixd.proxy.settings import Settings

NAME = "tiny"
DEADLINE = 20.0          # seconds for any one wait
ARCHS = ["qwen3", "qwen3_next", "qwen3_5", "falcon_h1", "gemma3_text"]
# plain KV: a state trims back to any prefix, so a prompt diverging inside a block restores
# tokens the stream (whole blocks, as vLLM's) cannot announce
TRIMMABLE = {"qwen3"}

SYSTEM = {"role": "system", "content": "You are a careful assistant who keeps notes. " * 12}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def endpoints() -> tuple[str, str]:
    """Two free loopback tcp endpoints: the stream's and its replay's."""
    a = free_port()
    while (b := free_port()) == a:
        pass
    return f"tcp://127.0.0.1:{a}", f"tcp://127.0.0.1:{b}"


@dataclass
class Turn:
    tokens: list[int]
    credited: int            # what the feed credited the prompt just before it was sent
    cached: int              # what the worker reports it restored
    reply: str
    cache: dict[str, Any]    # the worker's own breakdown (`prefixd.cache`): tier, miss


@dataclass
class Worker:
    gen: Generator
    client: TestClient
    held: Held
    feed: Feed
    stream: str
    replay: str
    # (sequence, time.time() when applied, the batch) of every batch the feed applied
    applied: list[tuple[int, float, Batch]] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        """The model goes (Generator.close: not twice)."""
        if not self.closed:
            self.closed = True
            self.gen.close()

    @property
    def announcer(self) -> Any:
        assert self.gen.announcer is not None
        return self.gen.announcer

    async def settled(self) -> None:
        """Wait until every change of the worker's tiers is published and the feed applied
        every batch published so far. A fresh worker's opening AllBlocksCleared reaches a
        subscriber that joined after it only with the next batch (vLLM's late joiner: it asks
        for a replay then); it holds nothing meanwhile."""
        assert self.gen.loaded is not None
        store, ann = self.gen.loaded.engine.store, self.announcer
        deadline = time.monotonic() + DEADLINE
        while True:
            if ann.settled(store):
                last, sent = self.feed.status.last_seq, ann.publisher.sent
                if last == sent - 1 or (last is None and sent == 1):
                    return
            assert time.monotonic() < deadline, (self.feed.status, self.feed.counts,
                                                 ann.info())
            await asyncio.sleep(0.005)

    async def tokens(self, body: dict[str, Any]) -> list[int]:
        resp = await self.client.post("/tokenize", json=body)
        assert resp.status == 200, await resp.text()
        return (await resp.json())["tokens"]

    async def turn(self, messages: list[dict[str, str]], namespace: str = "",
                   wait: bool = True) -> Turn:
        """One request, credited by the feed once it is up to date (`namespace`: sent in
        that cache partition; `wait` False: credited by the feed as it is)."""
        body = {"model": NAME, "messages": messages, "temperature": 0}
        tokens = await self.tokens(body)
        if wait:
            await self.settled()
        credited = self.held.held(tokens)
        headers = {NAMESPACE_HEADER: namespace} if namespace else {}
        async with asyncio.timeout(DEADLINE):
            resp = await self.client.post("/v1/chat/completions", json=body, headers=headers)
            assert resp.status == 200, await resp.text()
            out = await resp.json()
        assert out["usage"]["prompt_tokens"] == len(tokens)
        return Turn(tokens, credited, out["usage"]["prompt_tokens_details"]["cached_tokens"],
                    out["choices"][0]["message"]["content"],
                    (out.get("prefixd") or {}).get("cache") or {})

    async def cache_info(self) -> dict[str, Any]:
        resp = await self.client.get("/v1/cache")
        assert resp.status == 200
        return await resp.json()


@contextlib.asynccontextmanager
async def worker(model: Path, **settings: Any) -> AsyncIterator[Worker]:
    """A loaded worker publishing KV events on loopback, its app on a test server, and a
    feed of its stream (with replay) into a `Held`; everything closed after."""
    stream, replay = endpoints()
    s = WorkerSettings(_env_file=None, use_system_blas=False, max_tokens_default=6,
                       **{"disk_cache_bytes": 0, **settings},
                       kv_events=stream, kv_events_replay=replay)
    gen = Generator(s)
    gen.kv_topic = f"kv@test@{NAME}"
    feed: Feed | None = None
    w: Worker | None = None
    try:
        await gen.load(str(model))
        held = Held()
        applied: list[tuple[int, float, Batch]] = []
        feed = Feed(NAME, stream, held, replay=replay, topic="kv@",
                    on_batch=lambda f, b: applied.append((f.status.last_seq or 0,
                                                          time.time(), b)))
        feed.start()
        async with TestClient(TestServer(create_app(gen, NAME, s))) as client:
            w = Worker(gen, client, held, feed, stream, replay, applied)
            yield w
    finally:
        if feed is not None:
            await feed.stop()
        if w is not None:
            w.close()
        else:
            gen.close()


def conversation(reply: str) -> list[dict[str, str]]:
    return [SYSTEM, user("Tell me about rivers and lakes. " * 4), assistant(reply)]


def honest(t: Turn, trimmable: bool) -> None:
    """Credited what the worker restored: exactly, or (plain KV, restored inside a block)
    the block boundary below it."""
    assert t.credited <= t.cached, f"over-credited: {t}"
    if trimmable and t.cached % CHUNK:
        assert t.credited >= t.cached - t.cached % CHUNK, t
    else:
        assert t.credited == t.cached, t


# --- 1. honesty on every architecture --------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
async def test_credit_is_what_the_worker_restores(
        tiny_model_dir: Callable[[str], Path], arch: str) -> None:
    trimmable = arch in TRIMMABLE
    async with worker(tiny_model_dir(arch)) as w:
        first = [SYSTEM, user("Tell me about rivers and lakes. " * 4)]
        a1 = await w.turn(first)
        assert a1.credited == a1.cached == 0
        second = [*conversation(a1.reply), user("And the sea? " * 3)]
        a2 = await w.turn(second)
        third = [*second, assistant(a2.reply), user("And the mountains? " * 3)]
        a3 = await w.turn(third)
        # a follow-up restores the whole previous turn (its prompt and reply): exact
        assert a2.credited == a2.cached > len(a1.tokens), a2
        assert a3.credited == a3.cached > len(a2.tokens), a3
        # a second conversation sharing the system prompt
        b1 = await w.turn([SYSTEM, user("Tell me about deserts. " * 4)])
        honest(b1, trimmable)
        assert b1.credited > 0
        # edited earlier turns: the second question, the first answer, the first question
        edits = [[*conversation(a1.reply), user("And the ocean floor? " * 3)],
                 [*conversation(a1.reply + " And more."), user("Yes.")],
                 [SYSTEM, user("Tell me about rivers and seas. " * 4)]]
        for messages in edits:
            t = await w.turn(messages)
            honest(t, trimmable)
            assert t.credited > 0, t
        assert w.feed.complete and w.feed.counts["bad"] == 0
        assert w.held.counts["unplaced"] == w.held.counts["malformed"] == 0
        assert set(w.held.media()) == {"GPU"}
        # a cache partition's request restores from its partition only, which is never
        # announced (a consumer rebuilding keys from token ids would credit every key with
        # it): nothing is published for it. Credited what the shared partition holds, it is
        # over-credited: a router must not credit events to a partition's requests
        await w.settled()
        sent, blocks = w.announcer.publisher.sent, len(w.held)
        part = await w.turn(third, namespace="ab12")
        assert part.cached == 0 < part.credited
        await w.settled()
        assert (w.announcer.publisher.sent, len(w.held)) == (sent, blocks)


# --- 2. RAM evictions ------------------------------------------------------------------------
async def test_evicted_conversations_are_removed_and_credited_what_is_left(
        tiny_model_dir: Callable[[str], Path]) -> None:
    """A RAM budget of about two conversations: the oldest ones go, their blocks are removed
    from the stream, and returning to one is credited what the worker still restores of it
    (the system prompt the others share, or nothing)."""
    async with worker(tiny_model_dir("qwen3_next"), cache_bytes=1 << 18) as w:
        topics = ["rivers", "deserts", "forests", "glaciers", "volcanoes"]
        firsts = {}
        for topic in topics:
            messages = [SYSTEM, user(f"Tell me about {topic}. " * 6)]
            t = await w.turn(messages)
            honest(t, False)
            firsts[topic] = [*messages, assistant(t.reply), user("Go on. " * 3)]
        info = await w.cache_info()
        assert info["evicted_entries"] > 0, info
        await w.settled()
        assert w.held.counts["removed"] > 0
        # the oldest conversation's first turn is gone: credited the system prompt the others
        # hold, as the worker restores it (its miss: evicted)
        back = await w.turn(firsts["rivers"])
        assert back.credited == back.cached, back
        assert back.cache.get("miss") == "evicted" and back.cached < back.cache["known_tokens"]
        # a recent one is still there, whole
        recent = await w.turn(firsts["volcanoes"])
        assert recent.credited == recent.cached > len(recent.tokens) // 2, recent


# --- 3. the disk tier ------------------------------------------------------------------------
async def written(w: Worker) -> None:
    """Wait until the disk writer is idle and what it wrote is announced."""
    deadline = time.monotonic() + DEADLINE
    while (await w.cache_info())["disk"]["pending_jobs"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    await w.settled()


async def test_disk_blocks_stay_credited_after_ram_drops_them(
        tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """A RAM budget of about two conversations over a disk tier that writes every state
    at once: a conversation's blocks go to DISK too, RAM drops it (GPU removed, DISK stays)
    and its follow-up, restored from disk, is credited exactly that; a worker started anew
    on the same disk tier announces it, and is credited what it restores from it."""
    settings = {"cache_bytes": 1 << 18, "disk_cache_bytes": 1 << 28, "disk_write_delay": 0,
                "cache_dir": tmp_path}
    model = tiny_model_dir("qwen3_next")
    async with worker(model, **settings) as w:
        messages = [SYSTEM, user("Tell me about rivers. " * 6)]
        one = await w.turn(messages)
        follow_up = [*messages, assistant(one.reply), user("Go on. " * 3)]
        await written(w)
        assert w.held.media().get("DISK", 0) > 0, w.held.media()
        held_before = w.held.held(await w.tokens({"model": NAME, "messages": follow_up}))
        assert held_before > len(one.tokens)
        # other conversations push it out of RAM: its GPU blocks are removed, DISK stays
        for topic in ["deserts", "forests", "glaciers", "volcanoes"]:
            honest(await w.turn([SYSTEM, user(f"Tell me about {topic}. " * 6)]), False)
        assert (await w.cache_info())["evicted_entries"] > 0
        events = [e for _, _, b in w.applied for e in b.events]
        gone = {m: {h for e in events if isinstance(e, BlockRemoved) and e.medium == m
                    for h in e.block_hashes} for m in ("GPU", "DISK")}
        on_disk = {h for e in events if isinstance(e, BlockStored) and e.medium == "DISK"
                   for h in e.block_hashes}
        assert on_disk & gone["GPU"] - gone["DISK"], "no block left RAM while on disk"
        back = await w.turn(follow_up)
        assert back.cache.get("tier") == "disk", back
        assert back.credited == back.cached == held_before, back
        assert set(w.held.media()) == {"GPU", "DISK"}
        resume = [*follow_up, assistant(back.reply), user("More. " * 3)]
        await written(w)

    async with worker(model, **settings) as w:
        # a subscriber that joined after the opening batches (AllBlocksCleared, the disk
        # tier's blocks) learns of them only at the next batch, by replay (nothing tells it
        # that it missed the stream's last batch): an unrelated request's
        unrelated = await w.turn([{"role": "system", "content": "Be brief."}, user("Hi.")],
                                 wait=False)
        assert unrelated.cached == 0
        again = await w.turn(resume)
        assert w.feed.starts == 1 and w.feed.complete
        assert again.cache.get("tier") == "disk", again
        assert again.credited == again.cached > len(back.tokens), again


# --- 4. the stream's life --------------------------------------------------------------------
async def replayed(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    """The raw batches a publisher's replay endpoint holds from `start`."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: list[tuple[int, bytes]] = []
    try:
        await sock.send_multipart((b"", seq_bytes(start)))
        async with asyncio.timeout(DEADLINE):
            while True:
                _, seq, payload = await sock.recv_multipart()
                if seq_of(seq) < 0:
                    return out
                out.append((seq_of(seq), payload))
    finally:
        sock.close()


async def test_the_stream_opens_and_closes_with_all_blocks_cleared(
        tiny_model_dir: Callable[[str], Path]) -> None:
    async with worker(tiny_model_dir("qwen3_next"), kv_events_encoding="array") as w:
        messages = [SYSTEM, user("Tell me about rivers. " * 6)]
        one = await w.turn(messages)
        two = await w.turn([*messages, assistant(one.reply), user("Go on. " * 3)])
        assert two.credited == two.cached > 0
        await w.settled()
        assert w.feed.starts == 1 and w.feed.complete and w.held.counts["cleared"] == 1

        # on the wire: positional arrays, from sequence 0 (AllBlocksCleared) without gaps
        raw = await replayed(w.replay)
        assert [s for s, _ in raw] == list(range(w.announcer.publisher.sent))
        batches = [msgpack.unpackb(p, raw=False) for _, p in raw]
        assert all(isinstance(b, list) and isinstance(b[0], float) and isinstance(b[1], list)
                   for b in batches), batches
        assert batches[0][1] == [["AllBlocksCleared"]]
        stored = [e for b in batches for e in b[1] if e[0] == "BlockStored"]
        assert stored and all(isinstance(e[1], list) and isinstance(e[3], list)
                              and e[4] == len(e[3]) // len(e[1]) and e[6] == "GPU"
                              for e in stored), stored
        assert decode(raw[0][1]).events == (AllBlocksCleared(),)

        info = (await w.cache_info())["kv_events"]
        assert info["encoding"] == "array" and info["topic"] == f"kv@test@{NAME}"
        assert info["batches"] == w.announcer.publisher.sent == len(raw)
        assert info["announced"]["GPU"] == len(w.held) > 0 and info["announced"]["DISK"] == 0

        # the model goes: AllBlocksCleared, and the subscriber forgets everything
        w.close()
        deadline = time.monotonic() + DEADLINE
        while w.held.counts["cleared"] < 2:
            assert time.monotonic() < deadline, (w.feed.status, w.feed.counts)
            await asyncio.sleep(0.01)
        assert len(w.held) == 0 and w.held.held(two.tokens) == 0
        assert w.applied[-1][2].events == (AllBlocksCleared(),)


# --- 5. a managed worker's environment -------------------------------------------------------
def test_a_managed_worker_gets_its_backends_stream_not_the_proxys() -> None:
    settings = Settings(_env_file=None, use_system_blas=False,
                        kv_events="tcp://*:6001", kv_events_replay="tcp://*:6002",
                        kv_events_topic="proxy-topic", kv_events_encoding="array")
    own = BackendConfig(name="a", kind="mlx", model="m",
                        kv_events="tcp://127.0.0.1:5557",
                        kv_events_replay="tcp://127.0.0.1:5558")
    env = worker_env(own, settings, base={})
    assert env["PREFIXD_KV_EVENTS"] == "tcp://127.0.0.1:5557"
    assert env["PREFIXD_KV_EVENTS_REPLAY"] == "tcp://127.0.0.1:5558"
    assert "PREFIXD_KV_EVENTS_TOPIC" not in env
    assert env["PREFIXD_KV_EVENTS_ENCODING"] == "array"     # how, not where: shared

    none = BackendConfig(name="b", kind="mlx", model="m")
    env = worker_env(none, settings, base={"PREFIXD_KV_EVENTS": "tcp://*:7000"})
    assert not {"PREFIXD_KV_EVENTS", "PREFIXD_KV_EVENTS_REPLAY",
                "PREFIXD_KV_EVENTS_TOPIC"} & set(env)

    no_replay = own.model_copy(update={"kv_events_replay": None})
    env = worker_env(no_replay, settings, base={})
    assert env["PREFIXD_KV_EVENTS"] == "tcp://127.0.0.1:5557"
    assert "PREFIXD_KV_EVENTS_REPLAY" not in env
