"""One managed worker child process: how it is launched, heard and stopped.

Owns: the worker command line and environment (built in one place each), spawning the
child in its own process group, relaying its stdout/stderr line by line into the log
(logger `prefixd.worker`, tagged with the backend name) while keeping the last stderr
lines for error messages, and a stop that cannot hang (SIGTERM to the group, grace
period, SIGKILL, always reaped). Knows nothing about states or restarts: `supervisor`
(with `states` and `lifecycle`) does.
The worker's exit codes and its token variable are the worker's contract
(`backends/mlx/__main__.py`, `backends/mlx/server/app.py`), restated here so the proxy side
never imports mlx. Every worker one proxy run starts gets the same transfer secret (the
`transfer_secret` setting, else one generated for the run), so they can move prefix states
between them (`backends/mlx/server/seal.py`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import importlib.util
import json
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Callable, Mapping

from pydantic import SecretStr

from prefixd.backends.config import BackendConfig
from prefixd.backends.mlx.settings import WorkerSettings, worker_fields

wlog = logging.getLogger("prefixd.worker")

STDERR_TAIL_LINES = 20
_LINE_LIMIT = 1 << 20  # a worker may print one long traceback line; don't choke on it

EXIT_LOAD_FAILED = 1    # the worker could not load its model (or its settings): retrying won't help
EXIT_CANNOT_BIND = 2    # the worker could not bind its address (lost the race for a free port)
TOKEN_ENV = "PREFIXD_WORKER_TOKEN"   # with it set, every worker route but /health needs the token
TRANSFER_SECRET_ENV = "PREFIXD_TRANSFER_SECRET"   # WorkerSettings.transfer_secret

CommandBuilder = Callable[[int], list[str]]
# A worker's group is its backend's (`config.with_group` settled it), never copied from the
# proxy's own settings: a managed worker gets these from its BackendConfig only.
GROUP_FIELDS = frozenset({"group_hosts", "parallel"})
# One stream per worker: a backend's own `kv_events` / `kv_events_replay`, never the proxy's
PER_BACKEND = frozenset({"kv_events", "kv_events_replay", "kv_events_topic"})


def worker_command(model: str, port: int, served_name: str | None = None) -> list[str]:
    """The argv of a prefixd mlx worker serving `model` on 127.0.0.1:`port` (answering as
    `served_name`, the model name the proxy routes by)."""
    argv = [sys.executable, "-m", "prefixd.backends.mlx", "--model", model,
            "--host", "127.0.0.1", "--port", str(port)]
    return argv + (["--served-name", served_name] if served_name else [])


def _env_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, (list, dict)):
        return json.dumps(value)        # as the worker's settings parse it (never a repr)
    return str(value)


@functools.cache
def run_transfer_secret() -> str:
    """This proxy run's transfer secret, made on first use: every worker it starts without a
    `transfer_secret` setting gets it, and a restarted worker gets it again, so any two of its
    workers can move prefix states (and none outside the run can forge one)."""
    return secrets.token_urlsafe(32)


def worker_env(config: BackendConfig, settings: WorkerSettings,
               base: Mapping[str, str] | None = None, token: str | None = None,
               cache_bytes: int | None = None) -> dict[str, str]:
    """The child's environment: ours, plus the worker settings (`max_active`: the backend's
    `max_concurrency`, the requests the proxy sends it at once), the parent pid (so the worker
    exits when we are gone, even after a SIGKILL), the run's transfer secret, the backend's own
    `worker_env` and the start's `token` (secrets in the environment, never on the command
    line that any user can read).
    `cache_bytes`: the cache budget the model pool gave a backend that has none of its own."""
    # The proxy's own PREFIXD_* (its port, backends, a bad value overridden on its command
    # line) are not the worker's: it gets exactly the worker settings below.
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("PREFIXD_")}
    for field in worker_fields():
        value = getattr(settings, field)
        if value is not None and field not in GROUP_FIELDS | PER_BACKEND:
            env[f"PREFIXD_{field.upper()}"] = _env_value(value)
    cache = config.cache_bytes if config.cache_bytes is not None else cache_bytes
    if cache is not None:
        env["PREFIXD_CACHE_BYTES"] = str(cache)
    # the requests the proxy sends at once: the worker schedules them together (1: serial)
    env["PREFIXD_MAX_ACTIVE"] = str(config.concurrency)
    if len(config.hosts) > 1:           # a group worker: it starts and stops its ranks
        env["PREFIXD_GROUP_HOSTS"] = json.dumps(config.hosts)     # the backend's (`with_group`)
        env["PREFIXD_PARALLEL"] = config.parallel
    if config.kv_events:                # the worker binds it (a local address: docs/KV_EVENTS.md)
        env["PREFIXD_KV_EVENTS"] = config.kv_events
        if config.kv_events_replay:
            env["PREFIXD_KV_EVENTS_REPLAY"] = config.kv_events_replay
    if settings.transfer_secret is None:
        env[TRANSFER_SECRET_ENV] = run_transfer_secret()
    env = _with_blas(settings.use_system_blas, env)
    env.update(config.worker_env)           # a backend's own secret, if it has one, wins
    env.pop(TOKEN_ENV, None)               # only the supervisor's own token, or none
    if token is not None:
        env[TOKEN_ENV] = token
    env["PREFIXD_PARENT_PID"] = str(os.getpid())
    env["PYTHONUNBUFFERED"] = "1"  # lines reach our log as they are printed
    return env


def _with_blas(enabled: bool, env: dict[str, str]) -> dict[str, str]:
    """Preload the system OpenBLAS in the worker (Linux), or keep our own preload out of it
    when disabled. `blas` never imports mlx, so the proxy stays free of it."""
    if importlib.util.find_spec("prefixd.backends.mlx.model.blas") is None:
        return env
    from prefixd.backends.mlx.model.blas import blas_env

    return blas_env(enabled, env)


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to `timeout` for `event`; False on timeout. Not `asyncio.wait_for`: on 3.11 it
    swallows a cancellation that arrives as the event fires, which made stop() hang."""
    try:
        async with asyncio.timeout(max(timeout, 0.0)):
            await event.wait()
    except TimeoutError:
        return False
    return True


def _die_with_parent() -> Callable[[], None] | None:
    """Linux: a function run in the child between fork and exec that asks the kernel for
    SIGTERM when prefixd dies, even by SIGKILL (a child that is not a prefixd worker, such as
    llama-server, cannot watch `PREFIXD_PARENT_PID` itself). Resolved before the fork, so the
    child only makes one libc call."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM, 0, 0, 0)     # PR_SET_PDEATHSIG


_DEATHSIG = _die_with_parent()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now. The worker may lose a race for it; it then exits with
    'address in use' and the supervisor retries on a new port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class WorkerProcess:
    """A running child. `exited` is set once it is gone and its output is drained."""

    def __init__(self, proc: asyncio.subprocess.Process, tag: str,
                 on_exit: Callable[[], None] | None = None) -> None:
        self._proc = proc
        self.tag = tag
        self._on_exit = on_exit
        self.pid = proc.pid
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.exited = asyncio.Event()
        self._pumps = [asyncio.create_task(self._pump(proc.stdout, False), name=f"out:{tag}"),
                       asyncio.create_task(self._pump(proc.stderr, True), name=f"err:{tag}")]
        self._waiter = asyncio.create_task(self._wait(), name=f"wait:{tag}")

    @classmethod
    async def spawn(cls, argv: list[str], env: Mapping[str, str], tag: str,
                    on_exit: Callable[[], None] | None = None) -> WorkerProcess:
        """Start `argv` in a new session (own process group): a Ctrl-C aimed at prefixd's
        terminal does not hit the worker too, and stop() can signal the whole group. On Linux
        the child gets SIGTERM when prefixd dies (`_die_with_parent`)."""
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=dict(env), start_new_session=True,
            limit=_LINE_LIMIT, preexec_fn=_DEATHSIG)
        wlog.info("[%s] started pid %d: %s", tag, proc.pid, " ".join(argv))
        return cls(proc, tag, on_exit)

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (negative: killed by that signal), else None."""
        return self._proc.returncode

    def stderr_tail(self) -> list[str]:
        return list(self._stderr)

    def describe_exit(self) -> str:
        """'exited with code 3' / 'killed by SIGKILL', plus the last stderr lines."""
        rc = self._proc.returncode
        if rc is None:
            what = "is still running"
        elif rc < 0:
            what = f"was killed by {_signame(-rc)}"
        else:
            what = f"exited with code {rc}"
        tail = self.stderr_tail() if rc != 0 else []   # a clean exit needs no explaining
        return f"worker {what}" + (": " + " | ".join(tail[-5:]) if tail else "")

    async def _pump(self, stream: asyncio.StreamReader | None, is_err: bool) -> None:
        if stream is None:
            return
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # longer than the limit: asyncio dropped it; say so, go on
                wlog.info("[%s] (an output line over %d bytes was dropped)", self.tag,
                          _LINE_LIMIT)
                continue
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            if is_err:
                self._stderr.append(line)
            wlog.info("[%s] %s", self.tag, line)

    async def _wait(self) -> None:
        await self._proc.wait()
        # The pipes end when the child (and anything it forked) closes them; a grandchild
        # holding them open must not delay the exit notice for long.
        await asyncio.wait(self._pumps, timeout=1.0)
        for t in self._pumps:
            t.cancel()
        wlog.info("[%s] pid %d %s", self.tag, self.pid, self.describe_exit())
        self.exited.set()
        if self._on_exit is not None:
            self._on_exit()

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def terminate(self, grace_s: float) -> None:
        """SIGTERM the group, wait `grace_s`, then SIGKILL; returns once the child is reaped."""
        if not self.exited.is_set():
            self._signal_group(signal.SIGTERM)
            try:
                if not await wait_event(self.exited, grace_s):
                    wlog.warning("[%s] pid %d ignored SIGTERM for %gs; sending SIGKILL",
                                 self.tag, self.pid, grace_s)
            except asyncio.CancelledError:   # no time left to be polite
                self._signal_group(signal.SIGKILL)
                raise
        self._signal_group(signal.SIGKILL)  # also any grandchild left in the group
        await asyncio.shield(self._waiter)


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
