"""`python -m prefixd.backends.mlx` / `prefixd worker`: run one mlx worker process.

Owns: the worker's command line, its process lifecycle (BLAS re-exec, signals, following its
parent's death, ordered shutdown) and the listening socket (`--port`, or `--unix-socket`).
WorkerSettings come from the environment (PREFIXD_*; the supervisor passes worker settings that
way), and so do the optional per-start token `PREFIXD_WORKER_TOKEN` (see `server/app.py`) and the
transfer secret `PREFIXD_TRANSFER_SECRET` (a setting: see `server/cacheio.py`). Malformed HTTP on
the socket is answered by `server/protocol.py` (a JSON 400, one log line). The HTTP server starts
first and answers /health with 503 until the model is loaded, so a supervisor can tell "loading"
from "dead". SIGTERM/SIGINT, or the parent process going away, stop it within a couple of seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web
from pydantic import ValidationError
from pydantic_settings import SettingsError

from prefixd.backends.mlx.group.start import is_loopback
from prefixd.backends.mlx.model.blas import describe_blas, reexec_with_blas
from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.backends.mlx.scheduler.replay import is_follower
from prefixd.backends.mlx.scheduler.replay import serve as follower_serve
from prefixd.backends.mlx.server.app import TOKEN_ENV, create_app
from prefixd.backends.mlx.server.protocol import WorkerRunner
from prefixd.backends.mlx.settings import WorkerSettings
from prefixd.backends.supervision.parent import follow_parent, watch_parent

log = logging.getLogger("prefixd.worker")
PERSIST_TIMEOUT_S = 15.0   # writing the cache at shutdown (the supervisor's grace is longer)
# Set by the supervisor to its own pid: the worker exits when that process is gone.


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixd worker",
                                description="Serve one mlx-lm model with prefix checkpoints "
                                "(OpenAI API). WorkerSettings: PREFIXD_* environment variables; "
                                "PREFIXD_TRANSFER_SECRET (16+ characters, the same on every "
                                "worker that exchanges prefix states) lets it import them.")
    p.add_argument("--model", help="model folder, Hub id or built-in name "
                   "(default: PREFIXD_DEFAULT_MODEL)")
    p.add_argument("--served-name", help="model id in /v1/models and responses "
                   "(default: the folder name or the --model value)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; anything but loopback needs an API key")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route but "
                   "/health (default: $PREFIXD_WORKER_API_KEY); for a worker other machines use")
    p.add_argument("--port", type=int, default=8401)
    p.add_argument("--cache-dir", type=Path, help="models and the prompt cache's disk tier "
                   "(default: PREFIXD_CACHE_DIR, ~/.cache/prefixd)")
    p.add_argument("--unix-socket", type=Path, help="listen on this socket instead of a port")
    return p


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT or the parent's death, then end the process with the exit
    code (0; 1 if the settings are bad or the model cannot be loaded; 2 if the address cannot
    be bound) via os._exit:
    see the comment at the end."""
    args = _parser().parse_args(argv)
    try:
        settings = WorkerSettings(**({"cache_dir": args.cache_dir} if args.cache_dir else {}))
    except ValidationError as e:      # one line per field, never a value (it may be a secret)
        print("prefixd worker: bad settings: " + "; ".join(
            f"PREFIXD_{'.'.join(map(str, err['loc'])).upper()}: {err['msg']}"
            for err in e.errors(include_input=False)), file=sys.stderr)
        return 1
    except SettingsError as e:        # a list setting that is not JSON: its name, no value
        print(f"prefixd worker: bad settings: {e}", file=sys.stderr)
        return 1
    # Before any thread or socket exists: re-exec with the system OpenBLAS preloaded (Linux).
    reexec_with_blas(enabled=settings.use_system_blas)
    # Supervised, each line is re-logged by prefixd with its own timestamp and backend tag.
    stamp = "" if os.environ.get("PREFIXD_PARENT_PID") else "%(asctime)s "
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format=stamp + "%(levelname)s %(name)s: %(message)s")
    parent = follow_parent()
    spec = args.model or settings.default_model
    if is_follower():               # a group worker's rank > 0: no HTTP, the leader's journal
        rc = follower_serve(settings, spec)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    name = args.served_name or (Path(spec).name if "/" in spec else spec)
    generator = Generator(settings)
    rc, drained = asyncio.run(_serve(args, settings, generator, spec, name, parent))
    if not drained:
        log.warning("worker: generation thread still busy (loading?); not waiting for it")
    # Leave without interpreter finalization: it would join a thread stuck in a model load,
    # and MLX used from a non-main thread can abort in its C++ static destructors at exit
    # ("terminate called without an active exception", ml-explore/mlx#3126). Everything worth
    # keeping is done: the server is closed and generation stopped; flush what was printed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


async def _serve(args: argparse.Namespace, settings: WorkerSettings, generator: Generator,
                 spec: str, name: str, parent: int | None) -> tuple[int, bool]:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(watch_parent(parent, stop)) if parent else None
    # A per-start secret from the supervisor (env, never argv: other users can read argv),
    # or the key of a worker that serves other machines.
    token = args.api_key or os.environ.get("PREFIXD_WORKER_API_KEY") or os.environ.get(TOKEN_ENV)
    if not token and not args.unix_socket and not is_loopback(args.host):
        log.error("worker: refusing to listen on %s without an API key (--api-key or "
                  "PREFIXD_WORKER_API_KEY): anyone who can reach it could use the model",
                  args.host)
        return 2, True
    runner = WorkerRunner(create_app(generator, name, settings, token),
                          settings.header_timeout_s, handler_cancellation=True,
                          shutdown_timeout=2.0, access_log=None)
    await runner.setup()
    if args.unix_socket:
        site: web.BaseSite = web.UnixSite(runner, str(args.unix_socket))
    else:
        site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as e:
        log.error("worker: cannot listen on %s: %s", site.name, e)
        await runner.cleanup()
        return 2, True
    generator.kv_topic = settings.kv_events_topic or f"kv@{args.host}:{args.port}@{name}"
    log.info("worker: listening on %s; loading %s; %s", site.name, spec,
             "imports prefix states signed with its transfer secret" if settings.transfer_secret
             else "no transfer secret (PREFIXD_TRANSFER_SECRET): imports no prefix states")
    rc = await _load_then_wait(generator, spec, name, stop)
    log.info("worker: stopping")
    generator.cancel_all()  # every in-flight generation ends within one decode step
    await runner.cleanup()
    if args.unix_socket:
        args.unix_socket.unlink(missing_ok=True)
    drained = await generator.drain(timeout=2.0)
    if drained and rc == 0:
        await generator.persist(timeout=PERSIST_TIMEOUT_S)
    generator.close()
    if watcher:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return rc, drained


async def _load_then_wait(generator: Generator, spec: str, name: str,
                          stop: asyncio.Event) -> int:
    """Load the model (unless told to stop first), then serve until told to stop."""
    loading = asyncio.create_task(generator.load(spec))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        loading.cancel()  # the thread keeps loading; main() does not wait for it
        return 0
    if (error := loading.exception()) is not None:
        stopping.cancel()
        log.error("worker: cannot load model %s: %s", spec, error)
        return 1
    log.info("worker: serving %s as %r; BLAS: %s", spec, name, describe_blas())
    await stopping
    return 0


if __name__ == "__main__":
    sys.exit(main())
