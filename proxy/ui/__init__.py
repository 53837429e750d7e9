"""The status page: a static HTML/JS/CSS bundle served at `/` and `/ui/{file}`.

Owns: the files in `static/`, the routes that serve them, and `/ui/rules.json`: the
canonicalization rules (setting, description, the causes each fixes) from their registry,
`proxy/prefix/rules.py`, so the page keeps no copy. The page reads only JSON endpoints
(/status, /debug/prefix, /debug/prefix/{lane}, /ui/rules.json) and renders every value with
textContent; it needs no build step and loads nothing from outside prefixd. The page and the
rules are public (they hold no traffic); the endpoints it polls are behind PREFIXD_API_KEY
when set.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from prefixd.proxy.prefix.rules import page_data

STATIC = Path(__file__).resolve().parent / "static"

TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}

# Prompts shown on the page are untrusted: nothing but our own files may run or load.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer",
           "Content-Security-Policy": "default-src 'none'; script-src 'self'; "
                                      "style-src 'self'; img-src 'self' data:; "
                                      "connect-src 'self'; form-action 'none'; "
                                      "frame-ancestors 'none'; base-uri 'none'"}


def _files() -> dict[str, Path]:
    """name -> path of every servable file: an allow-list, so `{file}` can never leave
    `static/` (no `..`, no encoded slashes, no symlinks followed out of it)."""
    return {p.name: p for p in sorted(STATIC.iterdir())
            if p.is_file() and not p.is_symlink() and p.suffix in TYPES}


def add_routes(app: web.Application) -> None:
    """`GET /` (the page), `GET /ui/rules.json` and `GET /ui/{file}` (its assets)."""
    files = _files()

    def respond(path: Path) -> web.Response:
        return web.Response(body=path.read_bytes(), headers={
            "Content-Type": TYPES[path.suffix], **HEADERS})

    async def index(request: web.Request) -> web.Response:
        return respond(files["index.html"])

    async def asset(request: web.Request) -> web.Response:
        path = files.get(request.match_info["file"])
        if path is None:
            raise web.HTTPNotFound(text="no such file")
        return respond(path)

    async def rules(request: web.Request) -> web.Response:
        return web.json_response(page_data(), headers=HEADERS)

    app.router.add_get("/", index)
    app.router.add_get("/ui/rules.json", rules)      # before {file}: a route, not a file
    app.router.add_get("/ui/{file}", asset)
