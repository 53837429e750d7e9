"""The status page in a real browser: headless Chromium loads it from a real prefixd (in front
of the fake upstream) after a few multi-turn conversations, and the rendered DOM is checked."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp import web
from ui_helpers import Node, backends, chromium, dump_dom, open_page, play

from prefixd.proxy.ui import add_routes


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    if chromium() is None:
        pytest.skip("no chromium binary (apt-get install chromium)")
    return tmp_path / "chromium-profile"


async def lane_ids(http: aiohttp.ClientSession, base: str) -> dict[str, str]:
    """session id fragment -> lane id, from /debug/prefix."""
    async with http.get(base + "/debug/prefix") as r:
        lanes = [x["lane"] for x in (await r.json())["lanes"]]
    return {frag: next(x for x in lanes if frag in x)
            for frag in ("goose-7f3a", "57a121ec", "ses_6aade408", "aider-42", "task-1")}


def rows(card: Node) -> dict[str, str]:
    """A turn card's label -> value rows, whitespace collapsed."""
    return {kv.one("span", "k").text: " ".join(kv.one("span", "v").text.split())
            for kv in card.all("div", "kv")}


def bar_values(row: Node) -> list[str]:
    return [b.attrs["data-reuse"] for b in row.all("span", "bar")]


async def test_overview_shows_backends_lanes_and_a_mutation(upstream, start_proxy, http, profile):
    proxy = await start_proxy(backends=backends(upstream.url), prefix_excerpts=True)
    base = f"http://127.0.0.1:{proxy.port}"
    await play(http, base)
    lanes = await lane_ids(http, base)
    dom = await dump_dom(profile, base + "/")

    assert "hidden" not in dom.one(id="overview").attrs
    assert "hidden" in dom.one(id="login").attrs and "hidden" in dom.one(id="lane-view").attrs
    llama = dom.one("tr", data_backend="llama-server")
    assert "ready" in llama.text and "qwen3-coder-30b" in llama.text
    cells = [td.text for td in dom.one("tr", data_backend="vllm-gpu").all("td")]
    assert cells[3] == "0" and cells[4] == "0 / 4"     # queued, in flight / max
    assert cells[5].endswith(" ms") and " / " in cells[5]   # time behind others: median / worst
    assert cells[6:8] == ["—", "—"]          # no memory budget, no checkpoint store (openai)
    assert "hidden" in dom.one(id="model-memory").attrs

    goose = dom.one("tr", data_lane=lanes["goose-7f3a"])
    assert "goose" in goose.text
    verdict = goose.one("td", "verdict")
    assert "MUTATED" in verdict.text and "clock_time" in verdict.text
    assert verdict.one("span", "badge").classes >= {"v-mutated"}
    reuse = bar_values(goose)
    assert reuse[0] == "new" and len(reuse) == 4 and all(int(v) < 20 for v in reuse[1:])
    link = goose.one("a")
    assert link.attrs["href"] == "#lane=" + quote(lanes["goose-7f3a"], safe="")

    cc = dom.one("tr", data_lane=lanes["57a121ec"])
    assert bar_values(cc) == ["new", "100", "100", "100"] and "claude-cli" in cc.text
    saved = cc.all("td")[-1].text
    assert saved.endswith(" tok") and int(saved.split()[0].replace(",", "")) > 0
    assert bar_values(dom.one("tr", data_lane=lanes["task-1"])) == ["new"] + ["100"] * 4
    assert "opencode" in dom.one("tr", data_lane=lanes["ses_6aade408"]).text
    aider = dom.one("tr", data_lane=lanes["aider-42"])
    assert "BRANCH" in aider.text and "branch_edit" in aider.text
    assert dom.one(id="updated").text.startswith("updated ")


async def test_conversation_view_shows_each_turn(upstream, start_proxy, http, profile):
    proxy = await start_proxy(backends=backends(upstream.url), prefix_excerpts=True)
    base = f"http://127.0.0.1:{proxy.port}"
    await play(http, base)
    lane = (await lane_ids(http, base))["goose-7f3a"]
    dom = await dump_dom(profile, f"{base}/#lane={quote(lane, safe='')}")

    assert "hidden" in dom.one(id="overview").attrs
    assert lane in dom.one(id="lane-title").text and "goose" in dom.one(id="lane-summary").text
    assert len(dom.one(id="lane-chart").all("span", "bar")) == 4
    cards = dom.all("article", "turn")
    assert [c.attrs["data-turn"] for c in cards] == ["4", "3", "2", "1"]   # newest first
    t4 = cards[0]
    assert t4.one("span", "badge").text == "MUTATED"
    assert {c.text for c in t4.all("span", "chip")} >= {"clock_time", "iso_datetime"}
    kv = rows(t4)
    assert kv["where"].startswith("system[0] +") and " · token ~" in kv["where"]
    assert re.fullmatch(r"\d+ / \d+ tok \(\d+\.\d%\) · lost \d+ tok", kv["reused"])
    assert kv["would fix"].startswith("PREFIXD_CANON_RELOCATE_CLOCK_TIME=on keeps ")
    assert kv["backend cached"].startswith("14 / ") and kv["backend cached"].endswith("agrees")
    old, new = t4.one("pre", "old"), t4.one("pre", "new")
    assert "14:24:27" in old.text and "14:25:07" in new.text
    assert old.one("mark").text == "4:2" and new.one("mark").text == "5:0"
    assert "NEW" in cards[-1].text and not cards[-1].all("pre")

    cc_lane = (await lane_ids(http, base))["57a121ec"]
    dom = await dump_dom(profile, f"{base}/#lane={quote(cc_lane, safe='')}")
    t2 = dom.one("article", data_turn="2")
    badges = [b.text for b in t2.all("span", "badge")]
    assert badges[0] == "MUTATED" and badges[-1] == "APPEND"   # the client's, then what was sent
    assert {c.text for c in t2.all("span", "chip")} >= {"anthropic_billing_header"}
    assert rows(t2)["fixed by"].startswith("strip_billing_header · kept ")


async def test_prompt_markup_is_shown_as_text_never_run(upstream, start_proxy, http, profile):
    proxy = await start_proxy(backends=backends(upstream.url), prefix_excerpts=True)
    base = f"http://127.0.0.1:{proxy.port}"
    await play(http, base, hostile=True)
    async with http.get(base + "/debug/prefix") as r:
        lane = next(x["lane"] for x in (await r.json())["lanes"] if "evil" in x["lane"])
    dom = await dump_dom(profile, f"{base}/#lane={quote(lane, safe='')}")
    assert dom.one("title").text == "prefixd"                 # no injected script ran
    main = dom.one("main")
    assert not main.all("img") and not main.all("script")
    assert "<script>document.title='pwned'</script>" in dom.one("article", data_turn="2").text


async def test_a_key_protected_prefixd_shows_the_login_form(upstream, start_proxy, http,
                                                            profile):
    proxy = await start_proxy(backends=backends(upstream.url), api_key="sekret")
    base = f"http://127.0.0.1:{proxy.port}"
    await play(http, base, key="sekret")
    dom = await dump_dom(profile, base + "/")
    assert "hidden" not in dom.one(id="login").attrs
    assert "hidden" in dom.one(id="overview").attrs and not dom.all("tr", data_backend="up")
    assert dom.one("input", id="key").attrs["type"] == "password"
    assert "hidden" in dom.one(id="login-error").attrs      # no key was tried yet
    assert "API key needed" in dom.one(id="updated").text


async def test_login_form_stores_the_key_for_the_tab_and_retries(upstream, start_proxy, http,
                                                                  profile):
    proxy = await start_proxy(backends=backends(upstream.url), api_key="sekret")
    base = f"http://127.0.0.1:{proxy.port}"
    await play(http, base, key="sekret")
    async with open_page(profile, base + "/") as page:
        await page.until("!document.querySelector('#login').hidden")
        submit = ("document.querySelector('#key').value = {!r};"
                  "document.querySelector('#login-form').requestSubmit()")
        await page.eval(submit.format("wrong"))
        await page.until("!document.querySelector('#login-error').hidden")
        assert await page.eval("document.querySelector('#login-error').textContent") == \
            "That key was refused."
        assert await page.eval("sessionStorage.getItem('prefixd.apiKey')") is None
        await page.eval(submit.format("sekret"))
        await page.until("document.querySelectorAll('#lanes tr[data-lane]').length === 5")
        assert await page.eval("document.querySelector('#login').hidden") is True
        assert await page.eval("sessionStorage.getItem('prefixd.apiKey')") == "sekret"
        assert await page.eval("document.cookie") == ""
        await page.load("Page.reload")                  # the key outlives a reload of the tab
        await page.until("document.querySelectorAll('#backends tr[data-backend]').length === 2")
        assert await page.eval("document.querySelector('#login').hidden") is True


async def test_memory_and_checkpoint_store_columns_follow_the_status_contract(profile):
    """/status of managed mlx backends with their worker's cache (`backends[i].cache`) and
    their footprint in the memory budget (`footprint_bytes`, `footprint_source`,
    `memory_budget`, and `model_memory` for all), served canned: the page's side of the
    contract."""
    status = {"backends": [
        {"name": "q35", "kind": "mlx", "state": "ready", "up": True, "models": ["qwen3.5-9b"],
         "model": "/models/Qwen3.5-9B-4bit", "queue_depth": 2, "in_flight": 1,
         "max_concurrency": 1, "last_error": None, "footprint_bytes": 14_100_000_000,
         "waited_n": 7, "waited_p50_s": 0.4, "waited_max_s": 75.0,
         "footprint_source": "measured", "memory_budget": 24_000_000_000,
         "cache": {"bytes_used": 1_240_000_000, "budget": 8_000_000_000, "entries": 3,
                   "checkpoints": 41, "hit_tokens_total": 183_420,
                   "misses": {"evicted": 2},
                   "batch": {"decode_passes": 1200, "last_decode_batch": 4,
                             "mean_decode_batch": 3.6, "largest_decode_batch": 8},
                   "speculative": {"verify_passes": 310, "drafted": 2400, "accepted": 1650,
                                   "by_source": {"lookup": {"drafted": 2000, "accepted": 1400},
                                                 "mtp": {"drafted": 400, "accepted": 250}}},
                   "disk": {"bytes_used": 3_500_000_000, "budget": 32_000_000_000,
                            "records": 120, "written_bytes": 4_000_000_000,
                            "skipped_files": {}}},
         "index_entries": 40,
         "index": {"entries": 40, "conversations": 2, "tokens": 21_500,
                   "top": [{"lane": "lane-7f3a", "tokens": 18_000},
                           {"lane": "lane-11bc", "tokens": 3_500}],
                   "predicted_tokens": 52_000, "reported_tokens": 51_200,
                   "mispredictions": 1}},
        {"name": "ls", "kind": "llama", "state": "ready", "up": True, "models": ["smol"],
         "queue_depth": 0, "in_flight": 1, "max_concurrency": 2, "last_error": None,
         "cache": {"bytes_used": 0, "budget": 2_147_483_648},
         "llama_slots": {"slots": [{"id": 0, "tokens": 5210, "saved": False, "busy": True},
                                   {"id": 1, "tokens": 880, "saved": True, "busy": False}],
                         "placements": {"fresh": 3, "holds_prefix": 20, "restore": 6,
                                        "save_saved": 7, "restore_hit": 5,
                                        "restore_damaged": 1}},
         "slot_files": {"dir": "/c/llama-slots/ls/ab", "files": 4, "bytes": 410_000_000,
                        "budget_bytes": 8_000_000_000, "tokens": 17_000,
                        "counts": {"saved": 7, "superseded": 2, "damaged": 1}}},
        {"name": "gone", "kind": "mlx", "state": "failed", "up": False, "models": ["x"],
         "queue_depth": 0, "in_flight": 0, "max_concurrency": 1, "cache": None,
         "footprint_bytes": 9_000_000_000, "footprint_source": "estimate",
         "memory_budget": 24_000_000_000,
         "last_error": "worker exited with status 1: out of memory"}],
        "model_memory": {"budget_bytes": 24_000_000_000, "loaded": ["q35"],
                         "loaded_bytes": 14_100_000_000}}

    async def get_status(request: web.Request) -> web.Response:
        return web.json_response(status)

    async def lanes_off(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "prefix detection is off"}}, status=404)

    app = web.Application()
    app.router.add_get("/status", get_status)
    app.router.add_get("/debug/prefix", lanes_off)
    add_routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        dom = await dump_dom(profile, f"http://127.0.0.1:{port}/")
    finally:
        await runner.cleanup()
    q35 = [td.text for td in dom.one("tr", data_backend="q35").all("td")]
    assert q35[2] == "qwen3.5-9b/models/Qwen3.5-9B-4bit" and q35[3:5] == ["2", "1 / 1"]
    assert q35[5] == "400 ms / 1.3 min"      # time behind others, last 7: median / worst
    assert q35[6] == "14.1 GB / 24.0 GBmeasured"
    assert q35[7] == ("1.2 GB / 8.0 GB3 entries · 41 checkpoints · 183,420 hit tok"
                      "disk 3.5 GB / 32.0 GB · 120 recordsdecode batch 4 · mean 3.6 · max 8"
                      "drafts 1,650 / 2,400 accepted · 310 verify passes · MTP head 250 / 400"
                      "misses: 2 evicted")
    assert q35[8] == ("2 conversations · 21,500 tokpredicted 52,000 / reported 51,200 cached"
                      " tok · 1 misslane-7f3a 18,000 toklane-11bc 3,500 tok")
    links = [a.attrs.get("href") for a in dom.one("tr", data_backend="q35").all("a")]
    assert links == ["#lane=lane-7f3a", "#lane=lane-11bc"]
    ls = [td.text for td in dom.one("tr", data_backend="ls").all("td")]
    assert ls[7] == ("2 slots: 5,210 · 880*2 held · 1 busy · pinned: 20 holds_prefix, "
                     "0 copy, 6 restore, 3 freshsaves 7 · restores 5 hit, 1 damaged"
                     "slot files 4 files · 410 MB / 8.0 GBslot files dropped: 1 damaged")
    gone = [td.text for td in dom.one("tr", data_backend="gone").all("td")]
    assert gone[1] == "failed" and gone[5] == "—"    # no request served yet
    assert gone[6] == "9.0 GB / 24.0 GBestimate · not loaded"
    assert gone[7] == "—" and gone[8] == "—" and "out of memory" in gone[9]
    assert dom.one(id="model-memory").text.strip() == "models loaded: 14.1 GB of 24.0 GB (q35)"
    assert "detection is off" in dom.one(id="lanes-note").text
