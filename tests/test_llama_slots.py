"""llama-server slots (issue 17, item 4): the pure pin decision, the slot book, what /props and
/slots say, the start-up advice line; the fake llama-server against llama.cpp's placement
rules; the proxy pinning conversations on it; and (opt-in, PREFIXD_LLAMA_SERVER=1) the same
against the real binary."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import pytest
from fake_llama import FakeLlama, Served, lcp, render, tokenize

from prefixd.api.usage import Usage
from prefixd.backends.llama.info import ServerInfo, SlotState, advice, parse_props, parse_slots
from prefixd.proxy.bodies import with_field
from prefixd.proxy.routing.slotbook import Pin, SlotBook, SlotView, decide_slot, locate
from prefixd.proxy.routing.slots import SlotPlanner


def V(total: int = 4, active: int = 2, own: int | None = None, intact: bool = False,
      spare: int | None = None, settled: bool = True, trusted: bool = True) -> SlotView:
    return SlotView(total, active, own, intact, spare, settled, trusted)


@pytest.mark.parametrize(("view", "want"), [
    # its slot still holds its prompt: pin it, however many conversations there are
    (V(own=2, intact=True), Pin(2, "holds_prefix")),
    (V(active=12, own=2, intact=True), Pin(2, "holds_prefix")),
    # its slot was taken: the server's RAM cache restores it into whatever slot it picks
    (V(own=2, intact=False, spare=1), Pin(None, "taken")),
    # a new conversation, a slot per active one, a spare slot: that one
    (V(active=4, spare=3), Pin(3, "spare_slot")),
    # ... but more conversations than slots: the server places it
    (V(active=5, spare=3), Pin(None, "server")),
    # ... and no spare with a prompt (never-used slots): the server seeds one from RAM
    (V(active=2, spare=None), Pin(None, "server")),
    # one slot: nothing to choose; pins that kept missing: left to the server
    (V(total=1, own=0, intact=True), Pin(None, "single_slot")),
    (V(own=2, intact=True, trusted=False), Pin(None, "untrusted")),
    # a request the server placed is still unlocated: it may sit in any slot
    (V(own=2, intact=True, settled=False), Pin(None, "unsettled")),
    (V(active=4, spare=3, settled=False), Pin(None, "unsettled")),
    # idle slots may be cleared when another request starts: pinned when none started since
    # its own ended; else one pin at a time finds out; where they are cleared, none
    (SlotView(4, 2, 2, True, None, own_fresh=True, keeps_idle=None), Pin(2, "holds_prefix")),
    (SlotView(4, 2, 2, True, None, own_fresh=False, keeps_idle=None), Pin(2, "probe")),
    (SlotView(4, 2, 2, True, None, own_fresh=False, keeps_idle=None, probing=True),
     Pin(None, "probing")),
    (SlotView(4, 2, 2, True, None, own_fresh=True, keeps_idle=False), Pin(None, "cleared")),
    (SlotView(4, 4, None, False, 3, keeps_idle=False), Pin(None, "cleared")),
])
def test_pin_decision_table(view, want):
    assert decide_slot(view) == want


def test_book_learns_placements_and_forgets_what_it_cannot_know():
    book = SlotBook(3, active_s=100.0)
    book.seen("a", 0.0)
    book.placed("a", 0, 0.0)
    book.placed("b", 1, 1.0)
    assert book.view("a", 2.0) == SlotView(3, 2, 0, True, None, own_fresh=False,
                                           keeps_idle=None)
    book.placed("c", 0, 3.0)                        # c ran in a's slot
    assert book.view("a", 4.0).own_intact is False
    assert book.view("d", 500.0).spare == 1         # all idle for long: spare, LRU first
    book.placed("a", 2, 5.0)
    book.lost("b")                                  # b ran somewhere unknown
    v = book.view("a", 6.0)
    assert v.own == 2 and not v.own_intact and book.view("b", 6.0).own is None
    book.occupied([SlotState(0, 4096, False, 1, 100)])
    assert book.holder[0] == "?"


def test_two_missed_pins_in_a_row_stop_pinning():
    book = SlotBook(2)
    hold = Pin(0, "holds_prefix")
    assert not book.outcome(hold, cached=10, predicted=900)
    assert not book.outcome(hold, cached=880, predicted=900)    # a hit resets the count
    assert not book.outcome(hold, cached=10, predicted=900)
    assert not book.outcome(Pin(1, "spare_slot"), cached=0, predicted=900)   # not counted
    assert book.outcome(hold, cached=10, predicted=900) and not book.trusted


def test_the_pin_is_spliced_into_the_bytes_as_sent():
    assert with_field(b'{"model": "m",  "messages": []}', "id_slot", 3) == \
        b'{"id_slot":3,"model": "m",  "messages": []}'
    assert with_field(b' { } ', "id_slot", 0) == b' {"id_slot":0 } '


async def test_a_request_is_pinned_when_sent_and_learned_from_slots():
    """expect -> prepare (when sent) -> learn -> done, over a scripted /slots."""
    answers: dict[str, object] = {}

    async def fetch(path: str) -> object:
        return answers.get(path)

    def ran(slot: int, seed: int | None) -> list[dict]:
        return [{"id": slot, "is_processing": False, "id_task": 3, "n_prompt_tokens": 805,
                 "params": {"seed": seed}}]

    class Server:           # a llama-server's /slots, as the backend reads them
        name = "ls"

        async def fetch_slots(self) -> list[SlotState]:
            return parse_slots(await fetch("/slots"))

        def slot_keeper(self) -> None:
            return None

    ls = SlotPlanner(Server(), ServerInfo(2, 4096))  # type: ignore[arg-type]
    usage = Usage.parse({"prompt_tokens": 800, "completion_tokens": 5,
                         "prompt_tokens_details": {"cached_tokens": 700}})
    # a new conversation: the server places it, with a random seed that /slots shows back
    a1 = ls.expect("r1", "A", 0)
    sent = await ls.prepare("r1", b'{"messages":[]}')
    assert a1.marker is not None and sent == b'{"seed":%d,"messages":[]}' % a1.marker
    b1 = ls.expect("r2", "B", 0)
    await ls.prepare("r2", b"{}")
    assert b1.pin == Pin(None, "unsettled")          # A is not located yet
    answers["/slots"] = ran(1, a1.marker)
    await ls.learn(a1, usage)
    ls.done(a1)
    ls.done(b1)                                   # failed: where it ran is unknown
    assert not ls.book.view("A", 0.0).own_intact  # ... so A's slot may be gone too
    a2 = ls.expect("r3", "A", 700)
    await ls.prepare("r3", b'{"seed":7}')               # the client's seed: found by counts
    assert a2.marker is None
    answers["/slots"] = ran(0, 7)
    await ls.learn(a2, usage)
    ls.done(a2)
    # A's next turn finds its slot intact: pinned, spliced into the bytes as sent
    a3 = ls.expect("r4", "A", 800)
    assert await ls.prepare("r4", b'{"model":"m"}') == b'{"id_slot":0,"model":"m"}'
    await ls.learn(a3, usage)
    ls.done(a3)
    # the client's own id_slot is left alone
    c = ls.expect("r5", "C", 0)
    assert await ls.prepare("r5", b'{"id_slot":1}') == b'{"id_slot":1}'
    assert c.pin == Pin(None, "client")
    ls.done(c)
    assert ls.pins == {"server": 1, "unsettled": 1, "taken": 1, "holds_prefix": 1, "client": 1}
    assert await ls.prepare("unknown", b"{}") == b"{}"   # never announced: untouched


# llama.cpp's server (b7xxx): /props and /slots as it answers them
PROPS = {"default_generation_settings": {"params": {"n_predict": -1, "temperature": 0.8},
                                         "n_ctx": 4096},
         "total_slots": 4, "model_alias": "smollm2", "build_info": "b7100-abc",
         "endpoint_slots": True, "endpoint_props": False, "is_sleeping": False}
SLOTS = [{"id": 0, "n_ctx": 4096, "speculative": False, "is_processing": False,
          "id_task": 7, "n_prompt_tokens": 812, "n_prompt_tokens_processed": 90,
          "n_prompt_tokens_cache": 714, "params": {}, "next_token": [{}]},
         {"id": 1, "n_ctx": 4096, "speculative": False, "is_processing": True,
          "id_task": 9, "n_prompt_tokens": 760, "n_prompt_tokens_processed": 46,
          "n_prompt_tokens_cache": 714},
         {"id": 2, "n_ctx": 4096, "speculative": False, "is_processing": False},
         # released: llama-server cleared its counts; it holds 804 prompt + 7 generated
         {"id": 3, "n_ctx": 4096, "speculative": False, "is_processing": False,
          "id_task": 8, "n_prompt_tokens": 811, "n_prompt_tokens_processed": 0,
          "n_prompt_tokens_cache": 0}]


def test_props_and_slots_are_read_and_anything_else_is_not_llama_server():
    info = parse_props(PROPS)
    assert info == ServerInfo(4, 4096, None, None, "b7100-abc")
    assert parse_props({"object": "list", "data": []}) is None       # a /v1/models answer
    assert parse_props(None) is None and parse_props({"total_slots": 0}) is None
    assert parse_props({**PROPS, "slot_prompt_similarity": 0.1, "cache_ram_mib": 0}) == \
        ServerInfo(4, 4096, 0.1, 0, "b7100-abc")
    slots = parse_slots(SLOTS)
    assert [s.id for s in slots] == [0, 1, 2, 3] and slots[1].is_processing
    assert slots[2] == SlotState(2, 4096, False)
    assert parse_slots({"error": "not supported"}) == []
    # the slot whose last task reused 714 and computed 90 of 804 prompt tokens
    assert locate(slots, 804, 714) == 0
    assert locate(slots, 760, 714) == 1
    assert locate(slots, 804, 700) is None and locate(slots, None, 714) is None
    assert locate(slots, 804, 300, completion=8) == 3       # by what the slot holds


@pytest.mark.parametrize(("info", "level", "says"), [
    (ServerInfo(4, 4096, 0.1, 8192), logging.WARNING, "-sps 0.1 lets a new conversation"),
    (ServerInfo(1, 4096, 0.0, 0), logging.WARNING, "--cache-ram 0 disables"),
    (ServerInfo(4, 4096, 0.0, 256), logging.WARNING, "--cache-ram 256 leaves almost no room"),
    (ServerInfo(4, 4096), logging.INFO, "does not report -sps or --cache-ram"),
    (ServerInfo(4, 4096, 0.0, -1), logging.INFO, "slot settings keep caches"),
])
def test_the_advice_line_names_the_flag_to_change(info, level, says):
    got_level, line = advice("ls", info)
    assert got_level == level and says in line and "\n" not in line
    assert line.startswith(f"backend ls: llama-server with {info.total_slots} slot(s)")


# --- the fake llama-server against llama.cpp's placement rules ------------------------------

def chat(system: str, turns: list[str], replies: list[str] | None = None) -> dict:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        if i < len(turns) - 1:
            msgs.append({"role": "assistant", "content": (replies or [])[i]})
    return {"model": "m", "messages": msgs}


SYSTEM = "You are a careful coding agent working in a large repository. " * 60


async def ask(http, url: str, body: dict) -> dict:
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


@pytest.fixture
async def llama():
    made: list[FakeLlama] = []

    async def make(**kw) -> FakeLlama:
        f = FakeLlama(**kw)
        await f.start()
        made.append(f)
        return f

    yield make
    for f in made:
        await f.stop()


async def test_fake_llama_models_similarity_takeover_and_ram_restore(llama, http):
    """Two conversations, one slot. With -sps 0.1 the second one takes the slot over by
    similarity and neither is saved nor restored; with -sps 0 the slot is saved to RAM and
    each conversation's own prompt is restored; a named slot skips the restore."""
    for sps, restored in ((0.1, False), (0.0, True)):
        f = await llama(slots=1, similarity=sps)
        answers: dict[int, list[str]] = {0: [], 1: []}
        for turn in range(2):
            for c in (0, 1):
                turns = [f"conversation {c} asks question {k} " * 20 for k in range(turn + 1)]
                a = await ask(http, f.url, chat(SYSTEM, turns, answers[c]))
                answers[c].append(a["choices"][0]["message"]["content"])
                assert a["timings"]["cache_n"] == \
                    a["usage"]["prompt_tokens_details"]["cached_tokens"]
        second_turns = f.served[2:]
        assert all(s.restored == restored for s in second_turns), (sps, f.served)
        # restored: only the new question (~100 tokens) is computed; taken over: both turns
        assert all((s.prompt - s.cached < 150) == restored for s in second_turns), f.served
    f = await llama(slots=2)
    first = await ask(http, f.url, {**chat(SYSTEM, ["q"]), "id_slot": 1})
    again = chat(SYSTEM, ["q", "more"], [first["choices"][0]["message"]["content"]])
    await ask(http, f.url, {**again, "id_slot": 0})          # named: no restore from RAM
    assert f.served[-1] == Served(0, 0, f.served[-1].prompt, 0, False)


# --- the proxy in front of a fake llama-server with 4 slots ---------------------------------

class Ideal:
    """The single-backend ideal: tokens no earlier prompt + reply shares (computed once)."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []
        self.prompt = self.ideal_computed = 0

    def add(self, body: dict, reply: str) -> None:
        toks = tokenize(render(body))
        best = max((lcp(s, toks) for s in self.seen), default=0)
        self.prompt += len(toks)
        self.ideal_computed += len(toks) - min(best, len(toks) - 1)
        self.seen.append(toks + tokenize(reply))


async def play(http, port: int, convs: int, turns: int, seed: int = 0,
               ideal: Ideal | None = None) -> list[str]:
    """Interleaved conversations, no session id, shuffled order each round."""
    rng = random.Random(seed)
    replies: dict[int, list[str]] = {c: [] for c in range(convs)}
    url = f"http://127.0.0.1:{port}"
    for t in range(turns):
        order = list(range(convs))
        rng.shuffle(order)
        for c in order:
            body = chat(SYSTEM, [f"task {c}: step {k} " * 12 for k in range(t + 1)], replies[c])
            a = await ask(http, url, body)
            reply = a["choices"][0]["message"]["content"]
            replies[c].append(reply)
            if ideal is not None:
                ideal.add(body, reply)
    return [r[-1] for r in replies.values()]


def computed(f: FakeLlama) -> int:
    return sum(s.prompt - s.cached for s in f.served)


async def test_four_sessions_on_four_slots_are_pinned_and_keep_their_cache(
        llama, start_proxy, http, caplog):
    """No RAM cache (--cache-ram 0): only the slot each conversation keeps holds its prefix.
    prefixd pins each of 4 conversations to its slot from its second turn on, and every such
    turn reuses all of the previous prompt and reply; one warning names the flag."""
    f = await llama(slots=4, similarity=0.0, cache_ram_tokens=0)
    caplog.set_level(logging.INFO, logger="prefixd.backend")
    proxy = await start_proxy(backends=[{"name": "ls", "kind": "openai", "url": f.url,
                                         "models": ["m"], "max_concurrency": 4}])
    assert await proxy.proxy.backends["ls"].detect_slots() is not None
    slots = proxy.proxy.router.planner("ls")
    assert slots is not None and slots.info.total_slots == 4
    lines = [r for r in caplog.records if "llama-server with 4 slot(s)" in r.getMessage()]
    assert len(lines) == 1 and "--cache-ram 0 disables" in lines[0].getMessage()
    await play(http, proxy.port, convs=4, turns=5)
    pinned = [b.get("id_slot") for b in f.received]
    assert pinned[:4] == [None] * 4 and None not in pinned[4:]   # first turns: the server's
    # one pin across other requests finds out that idle slots keep their prompts
    assert slots.pins == {"server": 4, "probe": 1, "holds_prefix": 15}
    assert all(s.prompt - s.cached < 60 for s in f.served[4:]), f.served
    assert proxy.proxy.router.status("ls")["slots"] == 4


async def test_four_sessions_reuse_95_percent_of_the_ideal(llama, start_proxy, http):
    """With its RAM cache the server seeds new slots with the shared system prompt; pinned
    turns reuse their slot whole: >= 95% of the single-backend ideal reuse."""
    f = await llama(slots=4, similarity=0.0)
    proxy = await start_proxy(backends=[{"name": "ls", "kind": "openai", "url": f.url,
                                         "models": ["m"], "max_concurrency": 4}])
    assert await proxy.proxy.backends["ls"].detect_slots() is not None
    ideal = Ideal()
    await play(http, proxy.port, convs=4, turns=8, ideal=ideal)
    reuse = (ideal.prompt - computed(f)) / (ideal.prompt - ideal.ideal_computed)
    assert reuse >= 0.95, (reuse, f.served)


@pytest.mark.parametrize("wait_s", [30.0, 0.0])
async def test_new_conversations_wait_for_the_system_prompt_being_computed(
        llama, start_proxy, http, wait_s):
    """Four conversations start together on a 4-slot server, one system prompt: slots share
    no KV and an idle slot reaches the RAM cache only when a later task starts, so with no wait
    each first turn computes the system prompt (4 copies). Waiting for the first one to end,
    the second computes it again (its slot is picked and loaded before the first one's idle
    slot is saved) and the other two restore it from RAM: 2 copies."""
    f = await llama(slots=4, similarity=0.0, ms_per_token=0.5)
    proxy = await start_proxy(backends=[{"name": "ls", "kind": "openai", "url": f.url,
                                         "models": ["m"], "max_concurrency": 4}],
                              route_prefix_wait_s=wait_s)
    assert await proxy.proxy.backends["ls"].detect_slots() is not None
    url = f"http://127.0.0.1:{proxy.port}"

    async def first_turn(c: int) -> None:
        await asyncio.sleep(0.05 * c)
        await ask(http, url, chat(SYSTEM, [f"task {c}: read the parser module"]))

    await asyncio.gather(*(first_turn(c) for c in range(4)))
    system = len(tokenize(SYSTEM))
    copies = sum(s.prompt - s.cached for s in f.served) / system
    assert (round(copies) == 2) if wait_s else (round(copies) == 4), (copies, f.served)


async def test_more_conversations_than_slots_leave_placement_to_the_server(
        llama, start_proxy, http):
    """12 conversations on 4 slots with a RAM cache: prefixd pins only a slot that still
    holds the conversation, and learns from /slots where the server put the others; the
    server's RAM cache restores them (ratio to the ideal <= 1.3)."""
    f = await llama(slots=4, similarity=0.0)
    proxy = await start_proxy(backends=[{"name": "ls", "kind": "openai", "url": f.url,
                                         "models": ["m"]}])
    assert await proxy.proxy.backends["ls"].detect_slots() is not None
    slots = proxy.proxy.router.planner("ls")
    assert slots is not None
    ideal = Ideal()
    await play(http, proxy.port, convs=12, turns=4, ideal=ideal)
    assert computed(f) <= 1.3 * ideal.ideal_computed, (computed(f), ideal.ideal_computed)
    assert set(slots.pins) <= {"server", "taken", "holds_prefix", "probe"}
    assert slots.pins.get("server", 0) + slots.pins.get("taken", 0) >= 36
    assert any(s.restored for s in f.served)


async def test_back_to_back_turns_of_one_conversation_stay_in_its_slot(
        llama, start_proxy, http):
    """An agent's tool loop: turns of one conversation in a row, among others. The slot
    it was located in still holds it, so it is pinned there (not moved through RAM)."""
    f = await llama(slots=2, similarity=0.0)
    proxy = await start_proxy(backends=[{"name": "ls", "kind": "openai", "url": f.url,
                                         "models": ["m"]}])
    assert await proxy.proxy.backends["ls"].detect_slots() is not None
    url = f"http://127.0.0.1:{proxy.port}"
    for c in range(3):                                  # three conversations, one turn each
        await ask(http, url, chat(SYSTEM, [f"other {c} " * 10]))
    turns, replies = ["loop " * 10], []
    for _ in range(4):
        a = await ask(http, url, chat(SYSTEM, turns, replies))
        replies.append(a["choices"][0]["message"]["content"])
        turns.append(f"tool result {len(turns)} " * 10)
    tail = f.served[-3:]
    assert all(s.id_slot == tail[0].slot and not s.restored for s in tail), f.served
    assert all(s.cached >= s.prompt - 60 for s in tail)


async def test_similarity_takeover_is_measured_when_the_server_does_not_say(
        llama, start_proxy, http, caplog):
    """A build that does not report -sps: the second conversation lands in the first one's
    slot while three are empty, which only similarity selection does. One warning says so."""
    f = await llama(slots=4, similarity=0.1, report_settings=False)
    caplog.set_level(logging.INFO, logger="prefixd.backend")
    proxy = await start_proxy(backends=[{"name": "ls", "kind": "openai", "url": f.url,
                                         "models": ["m"]}])
    assert await proxy.proxy.backends["ls"].detect_slots() is not None
    slots = proxy.proxy.router.planner("ls")
    assert slots is not None and slots.info.similarity is None
    await play(http, proxy.port, convs=3, turns=1)
    assert [s.slot for s in f.served] == [3, 3, 3]
    warned = [r.getMessage() for r in caplog.records if "by prompt similarity" in r.getMessage()]
    assert len(warned) == 1 and "restart it with -sps 0" in warned[0]
    assert slots.status()["slot_takeover_seen"]


async def test_a_server_that_is_not_llama_server_gets_no_pins(start_proxy, upstream, http):
    proxy = await start_proxy(upstream.url)
    assert await proxy.proxy.backends["up"].detect_slots() is None
    async with http.post(f"http://127.0.0.1:{proxy.port}/v1/chat/completions",
                         json={"model": "fake", "messages": [{"role": "user",
                                                              "content": "hi"}]}) as r:
        assert r.status == 200
    assert "id_slot" not in upstream.received[-1]


# --- the real llama-server (opt-in) --------------------------------------------------------

@pytest.mark.network
async def test_real_llama_server_four_slots(start_proxy, http, tmp_path):
    from llama_process import LlamaServer, builtin_gguf, llama_server_binary

    binary = llama_server_binary(build=False)
    if binary is None:
        pytest.skip("no llama-server (PREFIXD_LLAMA_SERVER, PATH, or "
                    "bench/build_llama_server.sh's build)")
    server = LlamaServer(binary, builtin_gguf(), slots=4, ctx_per_slot=4096,
                         extra=["-sps", "0"], log=tmp_path / "llama.log")
    await server.start()
    try:
        proxy = await start_proxy(backends=[{"name": "ls", "kind": "openai", "url": server.url,
                                             "models": ["m"], "max_concurrency": 4}])
        assert await proxy.proxy.backends["ls"].detect_slots() is not None
        slots = proxy.proxy.router.planner("ls")
        assert slots is not None and slots.info.total_slots == 4
        url = f"http://127.0.0.1:{proxy.port}"
        cached, prompt = 0, 0
        replies: dict[int, list[str]] = {c: [] for c in range(4)}
        for t in range(3):
            for c in range(4):
                body = {**chat(SYSTEM[:1500], [f"task {c}: step {k}" for k in range(t + 1)],
                               replies[c]), "max_tokens": 8, "temperature": 0}
                a = await ask(http, url, body)
                replies[c].append(a["choices"][0]["message"]["content"])
                if t:
                    prompt += a["usage"]["prompt_tokens"]
                    cached += a["usage"]["prompt_tokens_details"]["cached_tokens"]
        # every later turn pinned to its own slot (one of them the probe that finds out
        # whether idle slots keep their prompts)
        assert slots.pins.get("holds_prefix", 0) + slots.pins.get("probe", 0) >= 8, slots.pins
        assert cached >= 0.9 * prompt, (cached, prompt)
    finally:
        await server.stop()


async def test_a_request_the_server_placed_is_located_while_it_runs():
    """A new conversation runs where the server put it (unpinned, marked by its seed); a slot
    shows that seed as soon as it takes the request, so the next request of another
    conversation is pinned to its own intact slot at once instead of waiting (`unsettled`)
    until the first one has answered."""
    answers: dict[str, object] = {}

    class Server:
        name = "ls"

        async def fetch_slots(self) -> list[SlotState]:
            return parse_slots(answers.get("/slots"))

        def slot_keeper(self) -> None:
            return None

    ls = SlotPlanner(Server(), ServerInfo(2, 4096))  # type: ignore[arg-type]
    ls.book.keeps_idle = True                        # known: idle slots keep prompts
    ls.book.seen("B", time.monotonic())              # B ran in slot 0 just now
    ls.book.placed("B", 0, time.monotonic())
    a1 = ls.expect("r2", "A", 0)
    await ls.prepare("r2", b"{}")
    assert a1.pin == Pin(None, "server") and a1.marker is not None
    b2 = ls.expect("r3", "B", 800)
    answers["/slots"] = [{"id": 0, "is_processing": False, "params": {"seed": 5}},
                         {"id": 1, "is_processing": True, "id_task": 9,
                          "params": {"seed": a1.marker}}]
    assert await ls.prepare("r3", b"{}") == b'{"id_slot":0}'
    assert b2.pin == Pin(0, "holds_prefix") and ls.book.holder[1] == "A"
    await ls.learn(a1, None)                         # its answer: nothing more to learn
    ls.done(a1)
    assert ls.book.holder[1] == "A" and ls.book.certain


async def test_a_server_that_clears_idle_slots_costs_one_missed_pin_at_most(
        llama, start_proxy, http):
    """llama-server's defaults (a unified KV cache with --cache-idle-slots) save every idle
    slot to the RAM cache and clear it when another request starts, so a pin to a
    conversation's slot across other requests finds it empty and computes everything (a
    named slot skips the RAM cache). One such pin finds that out; after it a conversation is
    pinned only when no other request started since its own ended, and the server's RAM
    cache restores the rest: within 1.1x of the server placing everything itself."""
    async def run(pins: bool) -> tuple[int, dict[str, int], int]:
        f = await llama(slots=4, similarity=0.0, kv_unified=True)
        proxy = await start_proxy(backends=[{"name": "ls", "kind": "openai", "url": f.url,
                                             "models": ["m"]}], route_prefix_wait_s=0)
        backend = proxy.proxy.backends["ls"]
        assert await backend.detect_slots() is not None
        if not pins:
            backend.slot_info = lambda: None        # type: ignore[method-assign]
        await play(http, proxy.port, convs=4, turns=5)
        planner = proxy.proxy.router.planner("ls")
        missed = sum(s.id_slot >= 0 and 2 * s.cached < s.prompt for s in f.served)
        return computed(f), dict(planner.pins) if planner is not None else {}, missed

    alone, _, _ = await run(pins=False)
    with_pins, pins, missed = await run(pins=True)
    assert missed == 1 and pins.get("probe") == 1, pins
    assert with_pins <= 1.1 * alone, (with_pins, alone, pins)
