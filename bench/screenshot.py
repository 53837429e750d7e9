"""Screenshots of the status page for the docs: a real prefixd in front of the tests' fake
OpenAI upstream, the conversations of tests/ui_helpers.py played through it, then headless
Chromium at 1280x900.

    .venv/bin/python bench/screenshot.py [--out docs/img]

Writes status.png (the overview) and conversation.png (the goose lane, whose clock moves in
its system prompt). Needs Debian's `chromium`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fake_upstream import FakeUpstream  # noqa: E402
from ui_helpers import backends, chromium, play, screenshot  # noqa: E402

from prefixd.backends.registry import build_backends  # noqa: E402
from prefixd.proxy.server import Server, make_proxy  # noqa: E402
from prefixd.proxy.settings import Settings  # noqa: E402


async def main(out: Path) -> int:
    if chromium() is None:
        print("screenshot: no chromium binary (apt-get install chromium)", file=sys.stderr)
        return 1
    up = FakeUpstream()
    await up.start()
    settings = Settings(_env_file=None, backends=backends(up.url), prefix_excerpts=True)
    server = Server(make_proxy(settings, build_backends(settings.backends, settings)))
    port = await server.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await play(http, base)
            async with http.get(base + "/debug/prefix") as r:
                lanes = [x["lane"] for x in (await r.json())["lanes"]]
        goose = next(x for x in lanes if "goose" in x)
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            await screenshot(Path(profile), base + "/", out / "status.png")
            await screenshot(Path(profile), f"{base}/#lane={quote(goose, safe='')}",
                             out / "conversation.png")
    finally:
        await server.shutdown(1.0)
        await up.stop()
    print(f"wrote {out / 'status.png'} and {out / 'conversation.png'}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    sys.exit(asyncio.run(main(p.parse_args().out)))
