"""The status page's routes on a real prefixd: the files, their types and headers, no way out
of the static folder, and which routes the API key guards. (The rendering is checked in a real
browser: tests/test_ui_browser.py.)"""

from __future__ import annotations

import json
import re

from yarl import URL

from prefixd.proxy.prefix.rules import RULES, page_data
from prefixd.proxy.ui import STATIC


async def test_page_and_assets_are_served_with_their_types(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    base = f"http://127.0.0.1:{proxy.port}"
    for path, ctype, marker in [("/", "text/html", b'<script type="module" src="/ui/app.js">'),
                                ("/ui/index.html", "text/html", b"<!doctype html>"),
                                ("/ui/app.js", "text/javascript", b"function tick()"),
                                ("/ui/render.js", "text/javascript", b"export function el("),
                                ("/ui/style.css", "text/css", b".badge")]:
        async with http.get(base + path) as r:
            assert r.status == 200, path
            assert r.content_type == ctype and r.charset == "utf-8"
            assert marker in await r.read()
            assert "script-src 'self'" in r.headers["Content-Security-Policy"]
            assert r.headers["X-Content-Type-Options"] == "nosniff"


async def test_no_file_outside_the_static_folder(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    base = f"http://127.0.0.1:{proxy.port}"
    for raw in ("/ui/..%2F__init__.py", "/ui/%2e%2e%2fapp.py", "/ui/..%2F..%2Fapp.py",
                "/ui/__init__.py", "/ui/", "/ui/nope.js", "/ui/%2Fetc%2Fpasswd",
                "/ui/static", "/ui/..", "/ui/app.js%00.css"):
        async with http.get(URL(base + raw, encoded=True)) as r:
            assert r.status == 404, raw
            assert b"import" not in await r.read()


async def test_the_key_guards_data_routes_not_the_page(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url, api_key="sekret")
    base = f"http://127.0.0.1:{proxy.port}"
    good = {"Authorization": "Bearer sekret"}
    for path in ("/status", "/metrics", "/debug/prefix", "/debug/prefix/x", "/v1/models"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            async with http.get(base + path, headers=headers) as r:
                assert r.status == 401, (path, headers)
                assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with http.get(base + path, headers=good) as r:
            assert r.status == (404 if path == "/debug/prefix/x" else 200), path
    for path in ("/", "/ui/app.js", "/ui/style.css", "/health", "/ready"):
        async with http.get(base + path) as r:
            assert r.status == 200, path


async def test_without_a_key_everything_is_open(upstream, start_proxy, http):
    proxy = await start_proxy(upstream.url)
    base = f"http://127.0.0.1:{proxy.port}"
    for path in ("/status", "/debug/prefix", "/metrics", "/"):
        async with http.get(base + path) as r:
            assert r.status == 200, path


async def test_the_page_reads_the_rules_from_the_server(upstream, start_proxy, http):
    """The page keeps no copy of the rules: it suggests fixes from /ui/rules.json, which the
    rule registry makes (public like the page: it holds no traffic)."""
    proxy = await start_proxy(upstream.url, api_key="sekret")
    async with http.get(f"http://127.0.0.1:{proxy.port}/ui/rules.json") as r:
        assert r.status == 200 and r.content_type == "application/json"
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert await r.json() == json.loads(json.dumps(page_data()))
    js = (STATIC / "app.js").read_text() + (STATIC / "render.js").read_text()
    assert '"/ui/rules.json"' in js
    for rule in RULES:
        assert rule.name not in js and rule.env not in js, rule.name
        assert not any(f'"{cause}"' in js for cause in rule.causes), rule.name


def test_page_renders_data_as_text_only():
    """Reports carry prompt text: the page must never parse data as HTML."""
    js = (STATIC / "app.js").read_text() + (STATIC / "render.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function"):
        assert sink not in js, sink
    assert "http://" not in js and "https://" not in js          # nothing from outside
    html = (STATIC / "index.html").read_text()
    assert not re.search(r"(src|href)=\"(https?:)?//", html)
