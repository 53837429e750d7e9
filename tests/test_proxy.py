"""The proxy on real loopback sockets in front of a fake upstream: relay, serialization,
queue overflow/timeout, disconnects, errors."""

from __future__ import annotations

import asyncio
import json
import time

from proxy_fixtures import read_until

from prefixd.metrics import render

CHAT = "/v1/chat/completions"


def chat(content: str = "hi", **extra) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **extra}


def url(server, path: str = CHAT) -> str:
    return f"http://127.0.0.1:{server.port}{path}"


async def test_non_stream_relay_passes_unknown_fields(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    async with http.post(url(proxy), json=chat(custom_field={"x": 1})) as r:
        assert r.status == 200
        body = await r.json()
        assert r.headers["X-Prefixd-Backend"] == "up"
    assert body["choices"][0]["message"]["content"] == "hello"
    assert upstream.received[0]["custom_field"] == {"x": 1}
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


async def test_stream_client_without_usage_gets_no_usage_chunk(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    async with http.post(url(proxy), json=chat(stream=True)) as r:
        text = (await r.read()).decode()
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert "tok0" in text and "tok2" in text and text.rstrip().endswith("data: [DONE]")
    assert '"usage"' not in text                          # the client did not ask for it
    assert upstream.received[0]["stream_options"] == {"include_usage": True}  # prefixd did


async def test_stream_client_asking_usage_gets_it(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    body = chat(stream=True, stream_options={"include_usage": True})
    async with http.post(url(proxy), json=body) as r:
        text = (await r.read()).decode()
    assert '"cached_tokens": 4' in text


async def test_first_chunk_arrives_before_upstream_finishes(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    body = chat(stream=True, fake={"chunks": 3, "hold_after_first": True})
    async with http.post(url(proxy), json=body) as r:
        first = await read_until(r, b"tok0")
        assert b"tok0" in first and upstream.finished == 0   # upstream still generating
        upstream.release.set()
        rest = await r.read()
    assert b"tok2" in rest and upstream.finished == 1


async def test_never_more_than_max_concurrency_under_50_clients(upstream, start_proxy, http):
    for limit in (1, 2):
        upstream.max_active = 0
        proxy = await start_proxy(upstream.url, backend={"max_concurrency": limit})
        body = chat(fake={"delay": 0.005})

        async def one(i: int, proxy=proxy, body=body) -> int:
            async with http.post(url(proxy), json={**body, "i": i}) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one(i) for i in range(50)))
        assert statuses == [200] * 50
        assert upstream.max_active == limit


async def test_fifo_order_and_queue_position_comments(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    first = asyncio.create_task(http.post(url(proxy), json=chat("0", fake={"hold": True})))
    await upstream.wait_received(1)
    queued = []
    for i in range(1, 5):                      # each is queued before the next is sent
        r = await http.post(url(proxy), json=chat(str(i), stream=True))
        assert f": queued position={i}".encode() in await read_until(r, b"position=")
        queued.append(r)
    upstream.release.set()
    assert (await first).status == 200
    for r in queued:
        assert b"[DONE]" in await r.read()
        r.release()
    (await first).release()
    assert [b["messages"][0]["content"] for b in upstream.received] == ["0", "1", "2", "3", "4"]


async def test_a_workers_place_in_line_reaches_the_client_while_it_waits(
        upstream, start_proxy, http):
    """A prefixd worker holding the request in its own queue streams `: queued position=N`
    before any of the answer: the proxy, which holds back what precedes the answer, sends
    those comments on at once (the client's place in line stays true when the proxy forwards
    every request to the worker)."""
    proxy = await start_proxy(upstream.url)
    answer = ('data: {"choices": [{"index": 0, "delta": {"content": "ok"}, '
              '"finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
    r = await http.post(url(proxy), json=chat("w", stream=True, fake={
        "raw": [": queued position=3\n\n", answer], "hold_after_first": True}))
    assert b": queued position=3" in await read_until(r, b"position=3")   # before release
    upstream.release.set()
    rest = await r.read()
    assert b'"ok"' in rest and b"[DONE]" in rest and rest.count(b"position=3") == 0
    r.release()


async def test_queue_full_gives_429_with_retry_after(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url, backend={"queue_depth": 2})
    held = [asyncio.create_task(http.post(url(proxy), json=chat(fake={"hold": True})))]
    await upstream.wait_received(1)
    for _ in range(2):
        held.append(asyncio.create_task(http.post(url(proxy), json=chat())))
    while proxy.proxy.queues["up"].waiting < 2:   # the two waiters reached the queue
        await asyncio.sleep(0)
    async with http.post(url(proxy), json=chat()) as r:
        assert r.status == 429
        assert r.headers["Retry-After"] == "1"
        err = (await r.json())["error"]
    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
    upstream.release.set()
    for t in held:
        resp = await t
        assert resp.status == 200
        resp.release()


async def test_queue_timeout_gives_503(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url, backend={"queue_timeout_s": 0.2})
    held = asyncio.create_task(http.post(url(proxy), json=chat(fake={"hold": True})))
    await upstream.wait_received(1)
    async with http.post(url(proxy), json=chat()) as r:
        assert r.status == 503
        assert "queue" in (await r.json())["error"]["message"]
    upstream.release.set()
    (await held).release()


async def test_queued_then_disconnected_never_reaches_upstream(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    held = asyncio.create_task(http.post(url(proxy), json=chat("held", fake={"hold": True})))
    await upstream.wait_received(1)
    r = await http.post(url(proxy), json=chat("gone", stream=True))
    await read_until(r, b"position=1")
    r.close()                                   # the client goes away while queued
    queue = proxy.proxy.queues["up"]
    while queue.waiting:                        # the proxy notices and dequeues it
        await asyncio.sleep(0)
    async with http.post(url(proxy), json=chat("after", stream=True)) as after:
        await read_until(after, b"position=1")
        upstream.release.set()
        assert b"[DONE]" in await after.read()
    (await held).release()
    assert [b["messages"][0]["content"] for b in upstream.received] == ["held", "after"]


async def test_mid_stream_disconnect_aborts_upstream_within_1s(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    body = chat(stream=True, fake={"chunks": 100000, "delay": 0.01})
    r = await http.post(url(proxy), json=body)
    await read_until(r, b"tok0")
    t0 = time.monotonic()
    r.close()
    while not upstream.aborted_at and time.monotonic() - t0 < 1.0:
        await asyncio.sleep(0.01)
    assert upstream.aborted_at and upstream.aborted_at[0] - t0 < 1.0
    async with http.post(url(proxy), json=chat()) as nxt:   # the next request starts
        assert nxt.status == 200


async def test_upstream_error_keeps_status_and_body(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    async with http.post(url(proxy), json=chat(fake={"status": 422})) as r:
        assert r.status == 422
        assert (await r.json())["error"]["message"] == "fake failure 422"


async def test_unreachable_upstream_gives_502_naming_backend(start_proxy, http):
    proxy = await start_proxy("http://127.0.0.1:9")   # discard port: nothing listens
    async with http.post(url(proxy), json=chat()) as r:
        assert r.status == 502
        err = (await r.json())["error"]
    assert "'up'" in err["message"] and err["type"] == "upstream_error"


async def test_model_routing(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    async with http.post(url(proxy), json=chat() | {"model": "nope"}) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "model_not_found"
    no_model = {"messages": [{"role": "user", "content": "x"}]}
    async with http.post(url(proxy), json=no_model) as r:
        assert r.status == 200                  # a single served model is the default
    assert upstream.received[-1]["model"] == "fake"
    async with http.get(url(proxy, "/v1/models")) as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["fake"]


async def test_api_key_guards_v1_but_not_health(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url, api_key="sekret")
    async with http.post(url(proxy), json=chat()) as r:
        assert r.status == 401
        assert (await r.json())["error"]["code"] == "invalid_api_key"
    async with http.post(url(proxy), json=chat(),
                         headers={"Authorization": "Bearer sekret"}) as r:
        assert r.status == 200
    async with http.get(url(proxy, "/health")) as r:
        assert r.status == 200


async def test_status_ready_and_metrics(upstream, start_proxy, http):
    from prometheus_client.parser import text_string_to_metric_families

    proxy = await start_proxy(upstream.url)
    await proxy.proxy.backends["up"].probe_once()

    def count() -> float:
        for fam in text_string_to_metric_families(render().decode()):
            if fam.name == "prefixd_requests":
                return sum(s.value for s in fam.samples if s.name == "prefixd_requests_total"
                           and s.labels["backend"] == "up" and s.labels["status"] == "200")
        return 0.0

    before = count()
    for _ in range(3):
        async with http.post(url(proxy), json=chat()) as r:
            await r.read()
    async with http.get(url(proxy, "/metrics")) as r:
        families = {f.name for f in text_string_to_metric_families(await r.text())}
    assert count() - before == 3
    assert {"prefixd_queue_wait_seconds", "prefixd_cached_prompt_tokens",
            "prefixd_backend_up", "prefixd_time_to_first_token_seconds"} <= families
    async with http.get(url(proxy, "/status")) as r:
        st = (await r.json())["backends"][0]
    assert st["name"] == "up" and st["state"] == "ready" and st["queue_depth"] == 0
    async with http.get(url(proxy, "/ready")) as r:
        assert r.status == 200 and (await r.json())["ready"] is True


async def test_ready_is_503_when_backend_down(start_proxy, http):
    proxy = await start_proxy("http://127.0.0.1:9")
    await proxy.proxy.backends["up"].probe_once()
    async with http.get(url(proxy, "/ready")) as r:
        assert r.status == 503
        assert "health probe" in json.dumps(await r.json())


async def test_prefix_report_header_debug_endpoint_and_billing_strip(upstream, start_proxy,
                                                                     http):
    proxy = await start_proxy(upstream.url)
    system = "x-anthropic-billing-header: cc_version=2.1.37; cch=fa690;\nYou are Claude Code."
    turn1 = {"model": "fake", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": "hi"}]}
    turn2 = {"model": "fake", "messages": [
        {"role": "system", "content": system.replace("fa690", "0aaa9")},
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "next"}]}
    headers = {"X-Session-Id": "s-1"}
    for body in (turn1, turn2):
        async with http.post(url(proxy), json=body, headers=headers) as r:
            assert r.status == 200
            verdict = r.headers["X-Prefixd-Prefix"]
    # what the client did, what R1 (on by default) did about it, what the backend got
    assert verdict.startswith("verdict=MUTATED;cause=anthropic_billing_header;"
                              "fixed=strip_billing_header;sent=APPEND;")
    sent = [b["messages"][0]["content"] for b in upstream.received]
    assert sent[0] == sent[1] == "You are Claude Code."  # the billing line never went upstream
    async with http.get(url(proxy, "/debug/prefix")) as r:
        lanes = (await r.json())["lanes"]
    lane = lanes[0]["lane"]
    async with http.get(url(proxy, f"/debug/prefix/{lane}")) as r:
        reports = (await r.json())["reports"]
    assert [rep["verdict"] for rep in reports] == ["NEW", "MUTATED"]
    assert [rep["sent_verdict"] for rep in reports] == ["NEW", "APPEND"]
    async with http.get(url(proxy, "/debug/prefix/nope")) as r:
        assert r.status == 404


async def test_detection_off_keeps_canonicalization_on(upstream, start_proxy, http):
    """PREFIXD_PREFIX_DETECT=false removes the reports, not the rules: the billing line
    (R1, on by default) still never goes upstream."""
    proxy = await start_proxy(upstream.url, prefix_detect=False)
    system = "x-anthropic-billing-header: cc_version=2.1.37; cch=fa690;\nYou are Claude Code."
    body = {"model": "fake", "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": "hi"}]}
    async with http.post(url(proxy), json=body, headers={"X-Session-Id": "s-2"}) as r:
        assert r.status == 200 and "X-Prefixd-Prefix" not in r.headers
    assert upstream.received[-1]["messages"][0]["content"] == "You are Claude Code."
    async with http.get(url(proxy, "/debug/prefix")) as r:
        assert r.status == 404


async def test_stream_refused_by_a_full_queue_gets_429_not_sse(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url, backend={"queue_depth": 1})
    held = [asyncio.create_task(http.post(url(proxy), json=chat(fake={"hold": True})))]
    await upstream.wait_received(1)
    waiting = await http.post(url(proxy), json=chat(stream=True))
    await read_until(waiting, b"position=1")
    async with http.post(url(proxy), json=chat(stream=True)) as r:
        assert r.status == 429 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["type"] == "rate_limit_error"
    upstream.release.set()
    assert b"[DONE]" in await waiting.read()
    waiting.release()
    (await held[0]).release()


async def test_client_gone_mid_stream_is_logged_499(upstream, start_proxy, http):
    from prometheus_client.parser import text_string_to_metric_families

    def count_499() -> float:
        for fam in text_string_to_metric_families(render().decode()):
            if fam.name == "prefixd_requests":
                return sum(s.value for s in fam.samples if s.name == "prefixd_requests_total"
                           and s.labels["status"] == "499" and s.labels["backend"] == "up")
        return 0.0

    proxy = await start_proxy(upstream.url)
    before = count_499()
    r = await http.post(url(proxy), json=chat(stream=True, fake={"chunks": 100000,
                                                                  "delay": 0.01}))
    await read_until(r, b"tok0")
    r.close()
    while not upstream.aborted_at:
        await asyncio.sleep(0.01)
    async with http.post(url(proxy), json=chat()) as nxt:   # the trace of the cut one is done
        assert nxt.status == 200
    assert count_499() - before == 1


async def test_model_alias_reaches_the_backend_under_its_served_name(upstream, start_proxy,
                                                                      http):
    proxy = await start_proxy(upstream.url, model_aliases={"claude-*": "fake", "x": "nope"})
    body = {"model": "claude-opus-4-5", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(url(proxy), json=body) as r:
        assert r.status == 200 and r.headers["X-Prefixd-Backend"] == "up"
    assert upstream.received[-1]["model"] == "fake"
    async with http.post(url(proxy), json={**body, "model": "x"}) as r:   # alias to nothing
        assert r.status == 404
        error = (await r.json())["error"]
    assert "alias 'x'" in error["message"] and "'nope'" in error["message"]
    assert error["param"] == "model" and error["code"] == "model_not_found"


async def test_a_backend_without_tokenize_endpoints_is_asked_once(upstream, start_proxy, http):
    """Exact token offsets are tried through /apply-template; an upstream that answers 404
    is remembered, not asked again on every mutated turn."""
    proxy = await start_proxy(upstream.url)
    for t in range(4):
        body = {"model": "fake", "messages": [
            {"role": "system", "content": f"The time is 10:4{t}:00. Be brief."},
            {"role": "user", "content": "hi"}]}
        async with http.post(url(proxy), json=body, headers={"X-Session-Id": "tk"}) as r:
            assert r.status == 200
            assert "verdict=MUTATED" in r.headers["X-Prefixd-Prefix"] or t == 0
    assert upstream.paths.count("/apply-template") == 1


async def test_claude_codes_reachability_probe_is_answered(upstream, start_proxy, http):
    """Claude Code 2.1.330 probes `HEAD /api/hello` on its base URL before it starts."""
    proxy = await start_proxy(upstream.url, api_key="k")
    async with http.head(f"http://127.0.0.1:{proxy.port}/api/hello") as r:
        assert r.status == 200
    async with http.get(f"http://127.0.0.1:{proxy.port}/api/hello") as r:
        assert r.status == 200 and await r.json() == {}


async def test_exact_offsets_are_asked_under_the_served_model_name(start_proxy, http):
    """A mutated turn's exact token offsets come from the backend's /apply-template +
    /tokenize, asked with the model the backend serves, not the client's alias for it."""
    from fake_upstream import FakeUpstream

    up = FakeUpstream(tokenizes=True)
    await up.start()
    try:
        proxy = await start_proxy(up.url, model_aliases={"claude-*": "fake"})
        for second in ("01", "02"):
            body = {"model": "claude-sonnet-4", "messages": [
                {"role": "system", "content": f"Agent. The time is 10:41:{second}. " * 4},
                {"role": "user", "content": "hello"}]}
            async with http.post(url(proxy), json=body) as r:
                assert r.status == 200
        assert r.headers["X-Prefixd-Prefix"].startswith("verdict=MUTATED")
        assert up.templated, "no exact offsets were asked for"
        assert {b["model"] for b in up.templated} == {"fake"}
    finally:
        await up.stop()
