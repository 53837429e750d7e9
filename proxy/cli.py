"""`prefixd` command line: serve, picker, config, explain, launch, worker, tiny-model, demo.

Settings are built here, once; a bad value exits with status 2 and names the variable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from prefixd.backends.config import with_group
from prefixd.proxy import launch
from prefixd.proxy.settings import BackendConfig, Settings, redacted


class ConfigError(Exception):
    pass


def _describe_errors(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = [str(x) for x in err["loc"]]
        var = "PREFIXD_" + loc[0].upper() if loc else "PREFIXD_?"
        where = f" (at {'.'.join(loc[1:])})" if len(loc) > 1 else ""
        got = err.get("input")
        shown = "" if isinstance(got, dict | list) else f"; got {got!r}"
        lines.append(f"{var}{where}: {err['msg']}{shown}")
    return "\n".join(lines)


def load_settings(env_file: str | None, **overrides: Any) -> Settings:
    """Build the one Settings object; ConfigError with a readable message on bad input."""
    kwargs = {k: v for k, v in overrides.items() if v is not None}
    if env_file is not None and not Path(env_file).is_file():
        raise ConfigError(f"--env-file {env_file}: no such file")
    try:
        if env_file is not None:
            return Settings(_env_file=env_file, **kwargs)
        return Settings(**kwargs)
    except ValidationError as e:
        raise ConfigError("invalid configuration:\n" + _describe_errors(e)) from None
    except SettingsError as e:  # a list/object setting whose value is not JSON
        m = re.search(r'field "(\w+)"', str(e))
        var = f"PREFIXD_{m.group(1).upper()}" if m else "a PREFIXD_* variable"
        raise ConfigError(f"invalid configuration:\n{var}: not valid JSON "
                          f"({e.__cause__ or e})") from None


def effective_backends(settings: Settings) -> Settings:
    """With no backend configured: one managed mlx backend on the built-in default model."""
    if settings.backends:
        return settings
    default = with_group(BackendConfig(name="default", kind="mlx", model=settings.default_model),
                         settings.group_hosts, settings.parallel)
    return settings.model_copy(update={"backends": [default]})


def _serve(args: argparse.Namespace) -> int:
    from prefixd.backends.registry import build_backends
    from prefixd.proxy.logs import setup_logging
    from prefixd.proxy.server import StartupError, serve

    settings = effective_backends(load_settings(args.env_file, host=args.host, port=args.port))
    setup_logging(settings.log_level, settings.log_format)
    backends = build_backends(settings.backends, settings)
    try:
        return asyncio.run(serve(settings, backends))
    except StartupError as e:     # a port in use, a model too large: exit 2, one line
        raise ConfigError(str(e)) from None


def _picker(args: argparse.Namespace) -> int:
    try:
        from prefixd.proxy.picker.server import serve
    except ImportError as e:
        raise ConfigError(f"prefixd picker needs the gateway extra (pip install "
                          f"'prefixd[gateway]'): {e}") from None
    from prefixd.proxy.logs import setup_logging

    settings = load_settings(args.env_file, host=args.host, picker_port=args.port,
                             picker_endpoints_file=args.endpoints)
    setup_logging(settings.log_level, settings.log_format)
    return asyncio.run(serve(settings))


def _config(args: argparse.Namespace) -> int:
    settings = effective_backends(load_settings(args.env_file))
    print(json.dumps(redacted(settings), indent=2, default=str))
    return 0


def _explain(args: argparse.Namespace) -> int:
    from prefixd.proxy.explain import ExplainError, run, target

    url, key = target(load_settings(args.env_file), args.url, args.api_key)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty()
                                       and "NO_COLOR" not in os.environ)
    try:
        sys.stdout.write(run(url, key, args.lane, args.n, color))
    except ExplainError as e:
        print(f"prefixd explain: {e}", file=sys.stderr)
        return 1
    return 0


def _launch(args: argparse.Namespace) -> int:
    from prefixd.proxy.launch import LaunchError, run

    try:
        return run(args, load_settings(args.env_file))
    except LaunchError as e:
        print(f"prefixd launch: {e}", file=sys.stderr)
        return 2


def _delegate(module: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(module).main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixd", description="Prompt-prefix caching that works "
                                "for local LLMs: a serializing, cache-aware OpenAI proxy.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the proxy (and its managed workers)")
    s.add_argument("--env-file", help="settings file (default: ./prefixd.env if present)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    k = sub.add_parser("picker", help="run the endpoint picker of a gateway (Envoy ext_proc, "
                       "the Gateway API Inference Extension): docs/GATEWAY.md")
    k.add_argument("--env-file", help="settings file (default: ./prefixd.env if present)")
    k.add_argument("--host")
    k.add_argument("--port", type=int, help="ext_proc and gRPC health (PREFIXD_PICKER_PORT)")
    k.add_argument("--endpoints", help="endpoints file (PREFIXD_PICKER_ENDPOINTS_FILE)")
    c = sub.add_parser("config", help="print the effective configuration, secrets redacted")
    c.add_argument("--env-file")
    e = sub.add_parser("explain", help="print a conversation's last prefix reports from a "
                       "running prefixd as a diff, with the setting that would fix each break")
    e.add_argument("lane", nargs="?", metavar="LANE",
                   help="lane id, as in /debug/prefix (default: the most recently active)")
    e.add_argument("-n", type=int, default=5, help="how many reports (default 5)")
    e.add_argument("--url", help="prefixd's base URL (default: http://HOST:PORT of the settings)")
    e.add_argument("--api-key", help="bearer key (default: PREFIXD_API_KEY)")
    e.add_argument("--env-file", help="settings file (default: ./prefixd.env if present)")
    e.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the diff (auto: when stdout is a terminal and NO_COLOR is unset)")
    launch.add_parser(sub)
    sub.add_parser("worker", help="run one mlx worker (normally started by `serve`)",
                   add_help=False)
    sub.add_parser("tiny-model", help="write a tiny random-weight model folder", add_help=False)
    sub.add_parser("demo", help="a one-minute multi-turn proof on tiny and default models",
                   add_help=False)
    return p


_DELEGATED = {"worker": "prefixd.backends.mlx.__main__",
              "tiny-model": "prefixd.backends.mlx.model.tiny",
              "demo": "prefixd.proxy.demo"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        return _delegate(_DELEGATED[argv[0]], argv[1:])
    rest: list[str] = []
    if argv[:1] == ["launch"] and "--" in argv:          # the client's own arguments
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if args.command == "launch":
        args.client_args = rest
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "explain":
            return _explain(args)
        if args.command == "launch":
            return _launch(args)
        if args.command == "picker":
            return _picker(args)
        return _config(args)
    except ConfigError as e:
        print(f"prefixd: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
