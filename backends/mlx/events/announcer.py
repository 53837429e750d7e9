"""The announcer: a thread that keeps a KV event stream (`kvevents.Publisher`) in step with
what the worker can restore, in every tier.

The generation thread calls `observe(store)` between two passes; when the store changed (its
`version`) it hands over the RAM holdings (references, no copies), the latest one winning.
The thread also watches the disk tier's `version` (its writer adds records off the
generation thread). On either change it diffs each tier against what it announced
(`kvevents.forest.Announced`, one per medium: `GPU` for RAM, the device's memory on a Mac,
as vLLM names its primary pool; `DISK` for the disk tier) and publishes the events in one
batch. A block leaving RAM but still on disk is removed from `GPU` only.

`AllBlocksCleared` opens the stream (a new worker holds nothing yet: a consumer that knew
its predecessor forgets it) and closes it (the model is unloaded); the disk tier's records,
which outlive the process, are announced again after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from prefixd.backends.mlx.cache.store import CheckpointStore
from prefixd.backends.mlx.events import holdings
from prefixd.kvevents.forest import Announced, Holding, restorable_positions
from prefixd.kvevents.prefix import Path, seed_key
from prefixd.kvevents.publisher import Publisher
from prefixd.kvevents.wire import AllBlocksCleared, Event

log = logging.getLogger("prefixd.worker.events")
RAM, DISK = "GPU", "DISK"
POLL_S = 0.02          # how often the thread looks at the disk tier


class Announcer:
    def __init__(self, publisher: Publisher, seed: str, disk: Any = None) -> None:
        self.publisher = publisher
        self.disk = disk
        self._seed = seed_key(seed)
        self._tiers = {RAM: Announced(RAM), DISK: Announced(DISK)}
        self._paths: dict[int, tuple[Sequence[int], Path]] = {}    # id(tokens) -> path
        self._disk_held: dict[str, holdings.Held] = {}
        self._ram: list[holdings.Held] = []
        self._seen_store = -1
        self._seen_disk = -1
        self._inbox: tuple[int, list[holdings.Held]] | None = None
        self.announced_version = -1       # the store version whose holdings are published
        self.announced_disk = -1          # the disk tier's version whose holdings are published
        self._wake = threading.Event()
        self._stop = False
        self.updates = 0
        self.update_s = 0.0               # time spent diffing, in total
        self.changed_at = 0.0             # time.time() of the last change handed over
        self.publisher.publish([AllBlocksCleared()])
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="prefixd-announcer")
        self._thread.start()

    # --- the generation thread ------------------------------------------------------------
    def observe(self, store: CheckpointStore) -> None:
        """Between two passes: hand over the RAM holdings if the store changed."""
        if store.version == self._seen_store:
            return
        self._seen_store = store.version
        self._inbox = (store.version, holdings.ram(store))
        self.changed_at = time.time()
        self._wake.set()

    # --- the announcer thread --------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(POLL_S)
            self._wake.clear()
            try:
                self._step()
            except Exception:
                log.exception("kv events: an update failed; the next change retries")

    def _step(self) -> None:
        events: list[Event] = []
        inbox, self._inbox = self._inbox, None
        if inbox is not None:
            self._ram = inbox[1]
            events += self._update(RAM, self._ram)
        version = self.disk.version if self.disk is not None else -1
        if version != self._seen_disk:
            self._seen_disk = version
            self._disk_held = holdings.disk(self.disk, self._disk_held)
            events += self._update(DISK, list(self._disk_held.values()))
        if events:
            self.publisher.publish(events)
        if inbox is not None:
            self.announced_version = inbox[0]
        self.announced_disk = version

    def settled(self, store: CheckpointStore) -> bool:
        """Whether every change of `store` and of the disk tier so far is published and sent
        (a test's or bench's wait: then `publisher.sent` counts every batch that describes
        them)."""
        disk = self.disk.version if self.disk is not None else -1
        return self.announced_version == store.version and self.announced_disk == disk \
            and self._inbox is None and self.publisher.pending() == 0

    def _update(self, medium: str, held: list[holdings.Held]) -> list[Event]:
        t0 = time.perf_counter()
        paths: list[Holding] = []
        live: dict[int, tuple[Sequence[int], Path]] = {}
        for tokens, trims, points in held:
            key = id(tokens)
            cached = self._paths.get(key)
            if cached is None or cached[0] is not tokens:
                cached = (tokens, Path(self._seed, tokens))
            live[key] = cached
            paths.append((cached[1], restorable_positions(len(tokens), trims, points)))
        # paths of both tiers stay cached while either holds them
        keep = {id(t) for t, _, _ in (self._ram if medium == DISK else
                                      self._disk_held.values())}
        self._paths = {k: v for k, v in self._paths.items() if k in keep} | live
        events = self._tiers[medium].update(paths)
        self.updates += 1
        self.update_s += time.perf_counter() - t0
        return events

    def info(self) -> dict[str, Any]:
        """What /v1/cache shows of the stream."""
        return {"endpoint": self.publisher.endpoint,
                "replay_endpoint": self.publisher.replay_endpoint,
                "topic": self.publisher.topic.decode(), "encoding": self.publisher.encoding,
                "batches": self.publisher.sent, "replays": self.publisher.replays,
                "announced": {m: len(t.nodes) for m, t in self._tiers.items()},
                "updates": self.updates, "update_s": round(self.update_s, 4)}

    def close(self, timeout: float = 1.0) -> None:
        """The model goes: `AllBlocksCleared`, then the sockets close."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        self.publisher.publish([AllBlocksCleared()])
        self.publisher.close(timeout)


def start(settings: Any, engine: Any, seed: str, topic: str) -> Announcer:
    """The announcer of a loaded worker (`PREFIXD_KV_EVENTS` set); OSError if its endpoints
    cannot be opened."""
    publisher = Publisher(settings.kv_events, settings.kv_events_replay, topic,
                          settings.kv_events_buffer, settings.kv_events_encoding)
    announcer = Announcer(publisher, seed, engine.tiers.disk)
    announcer.observe(engine.store)
    log.info("worker: KV events on %s (topic %r%s)", settings.kv_events, topic,
             f", replay on {settings.kv_events_replay}" if settings.kv_events_replay else "")
    return announcer
