"""The endpoints a picker picks from, and what it knows of each now.

Owns: each endpoint's declaration (from the settings' `backends`, each with a `url`, and from
an endpoints file the picker re-reads when it changes), its health and models (probed:
`GET /v1/models`, which llama-server, vLLM, SGLang and prefixd workers all answer), its
generation (a new one after it was seen down: its cache is taken as lost), and the requests
this picker has in flight there. `snapshot()` gives the routing core its `Endpoint`s.

The file is JSON: `{"endpoints": [{"address": "10.0.0.7:8000", "models": ["qwen3"],
"name": "a", "max_concurrency": 1, "queue_depth": 64}, ...]}` (or the list alone); only
`address` (ip:port: the pick names endpoints by IP, as Envoy's override_host policy and
its STATIC pool list them) is required; `kv_events` (and `kv_events_replay`, `kv_events_topic`)
name its KV event stream (docs/KV_EVENTS.md). A file that
does not parse is logged and the endpoints stay as they were.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from prefixd.backends.config import BackendConfig
from prefixd.metrics import picker as m
from prefixd.proxy.routing.core import Endpoint
from prefixd.proxy.routing.follow import Stream, streams_of

log = logging.getLogger("prefixd.picker")


@dataclass(frozen=True)
class Declared:
    """An endpoint as declared: where it listens, the models it was said to serve (empty:
    what its /v1/models says), how many requests it runs at once and queues."""

    name: str
    address: str
    models: tuple[str, ...] = ()
    max_concurrency: int = 1
    queue_depth: int = 64
    stream: Stream | None = None      # its KV event stream, when it publishes one
    api_key: str | None = None        # a backend's key (the picker's own calls: /tokenize)


def from_backends(configs: list[BackendConfig]) -> list[Declared]:
    """The settings' backends that have a URL (managed workers have none: a picker does not
    start model servers). A host name is resolved once, here: the pick names an IP."""
    out = []
    for c in configs:
        parts = urlsplit(c.url or "")
        if parts.hostname is None:
            continue
        try:
            ip = ipaddress.ip_address(parts.hostname)
        except ValueError:
            try:
                ip = ipaddress.ip_address(socket.getaddrinfo(
                    parts.hostname, None, proto=socket.IPPROTO_TCP)[0][4][0])
            except OSError as e:
                log.error("picker: backend %s (%s) not used: %s", c.name, c.url, e)
                continue
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = f"[{ip}]" if ip.version == 6 else str(ip)
        out.append(Declared(c.name, f"{host}:{port}", tuple(c.models), c.concurrency,
                            c.queue_depth, streams_of([c]).get(c.name),
                            c.api_key.get_secret_value() if c.api_key else None))
    return out


def from_file(text: str) -> list[Declared]:
    """The endpoints of a file's text (see the module docstring); ValueError if malformed."""
    data = json.loads(text)
    items = data.get("endpoints") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError("expected a list of endpoints, or {\"endpoints\": [...]}")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("address"), str) or \
                ":" not in item["address"]:
            raise ValueError(f"endpoint {i}: 'address' (ip:port) is required")
        models = item.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ValueError(f"endpoint {i}: 'models' must be a list of names")
        concurrency, depth = item.get("max_concurrency", 1), item.get("queue_depth", 64)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                   for n in (concurrency, depth)) or concurrency < 1:
            raise ValueError(f"endpoint {i}: max_concurrency >= 1 and queue_depth >= 0")
        kv, replay = item.get("kv_events"), item.get("kv_events_replay")
        if not all(v is None or (isinstance(v, str) and "://" in v) for v in (kv, replay)):
            raise ValueError(f"endpoint {i}: kv_events and kv_events_replay are ZMQ "
                             "endpoints such as tcp://10.0.0.7:5557")
        out.append(Declared(str(item.get("name") or item["address"]), item["address"],
                            tuple(models), concurrency, depth,
                            Stream(kv, replay, str(item.get("kv_events_topic", "")))
                            if kv else None))
    return out


class Endpoints:
    def __init__(self, declared: list[Declared], file: Path | None = None,
                 probe_s: float = 2.0) -> None:
        self.static, self.file, self.probe_s = declared, file, probe_s
        self._from_file: list[Declared] = []
        self._mtime: float | None = None
        self.up: dict[str, bool] = {}               # as of the last probe (unknown: up)
        self.models: dict[str, tuple[str, ...]] = {}   # what its /v1/models said
        self.generation: collections.Counter[str] = collections.Counter()
        self.inflight: collections.Counter[str] = collections.Counter()
        self.reload()

    @property
    def declared(self) -> list[Declared]:
        seen: dict[str, Declared] = {}
        for d in [*self.static, *self._from_file]:
            seen.setdefault(d.name, d)
        return list(seen.values())

    def reload(self) -> bool:
        """Re-read the endpoints file if it changed; True if it did."""
        if self.file is None:
            return False
        try:
            mtime = self.file.stat().st_mtime
        except OSError:
            mtime = None
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        try:
            self._from_file = from_file(self.file.read_text()) if mtime is not None else []
        except (OSError, ValueError) as e:
            log.error("picker: endpoints file %s not used: %s", self.file, e)
            return False
        log.info("picker: %d endpoints from %s", len(self._from_file), self.file)
        return True

    def snapshot(self) -> list[Endpoint]:
        return [Endpoint(d.name, d.models or self.models.get(d.name, ()),
                         self.up.get(d.name, True), self.inflight[d.name], d.max_concurrency,
                         self.generation[d.name], self.up.get(d.name, True), d.address)
                for d in self.declared]

    def by_address(self, address: str) -> str | None:
        return next((d.name for d in self.declared if d.address == address), None)

    def limit(self, name: str) -> int:
        """Requests in flight at most before the endpoint is full (runs + queue)."""
        d = next(d for d in self.declared if d.name == name)
        return d.max_concurrency + d.queue_depth

    def streams(self) -> dict[str, Stream]:
        """The KV event streams of the declared endpoints that have one."""
        return {d.name: d.stream for d in self.declared if d.stream is not None}

    async def run(self, round_done: Callable[[], Awaitable[None]] | None = None) -> None:
        """Re-read the file and probe every endpoint, every `probe_s`, until cancelled;
        `round_done` after each round (the picker follows the streams declared now)."""
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.probe_s))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                self.reload()
                await asyncio.gather(*(self._probe(session, d) for d in self.declared))
                if round_done is not None:
                    await round_done()
                await asyncio.sleep(self.probe_s)

    async def _probe(self, session: aiohttp.ClientSession, d: Declared) -> None:
        ok, models = False, None
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with session.get(f"http://{d.address}/v1/models") as r:
                ok = r.status < 500
                if r.status == 200:
                    models = _model_ids(await r.json(content_type=None))
        if self.up.get(d.name, True) is False and ok:
            self.generation[d.name] += 1       # back after being down: its cache is gone
        if self.up.get(d.name) is not ok:
            log.info("picker: endpoint %s (%s) is %s", d.name, d.address,
                     "up" if ok else "down")
        self.up[d.name] = ok
        m.ENDPOINT_UP.labels(d.name).set(int(ok))
        if models is not None:
            self.models[d.name] = models


def _model_ids(body: Any) -> tuple[str, ...] | None:
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    return tuple(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))
