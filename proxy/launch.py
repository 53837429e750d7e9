"""`prefixd launch claude|codex|opencode|aider [--model M] [--print] [-- client args]`: run a
coding agent against a running prefixd with nothing set by hand.

It asks prefixd which models it serves (`GET /v1/models`): the only one, or `--model`; and that
model's context window. Started right after `prefixd serve`, it waits (`--wait`, with a
message) until prefixd answers and knows the window. Then it gives the client, through its
environment and command line only (nothing is written: not the user's config files, not the
client's), the base URL, the key, the model for every role (Claude Code's small/fast and
sub-agent models too), the window to compact at in the setting the client's current version
honours at that size, a permission mode that needs no classifier call to the local model, and
every switch it has to stop update checks, telemetry, error reports, price-list fetches and
other calls to its vendor; then it execs the client in the caller's directory. `--print` shows
the lines for a shell profile instead.

Owns: the per-client recipes (`RECIPES`), pure functions of a `Target`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prefixd.proxy.settings import Settings

INSTALL = {"claude": "npm install -g @anthropic-ai/claude-code",
           "codex": "npm install -g @openai/codex",
           "opencode": "npm install -g opencode-ai",
           "aider": "pip install aider-chat"}
PRIVATE = Path("~/.cache/prefixd/launch").expanduser()   # what a client can read only from a file
CLAUDE_MIN_COMPACT_WINDOW = 100_000   # Claude Code reads an auto-compact window below as this
WAIT_S = 120.0                        # how long launch waits for the model's window
UNREACHABLE_WAIT_S = 10.0             # and for a daemon that does not answer yet


class LaunchError(Exception):
    """A launch that cannot go ahead, in one line a user can act on."""


class Unreachable(LaunchError):
    """No prefixd answers at the URL (yet)."""


@dataclass(frozen=True)
class Target:
    url: str                 # prefixd's base URL, no trailing /v1
    key: str
    model: str
    window: int | None       # the model's context window, when prefixd knows it


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()          # the caller's variables the client must not see
    files: dict[Path, str] = field(default_factory=dict)   # in prefixd's own directory


def output_tokens(window: int) -> int:
    """The answer size to give a client for `window`: a quarter of it, at least 1,024."""
    return max(1024, window // 4)


def _has_flag(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def claude(t: Target, args: list[str]) -> Launch:
    # ANTHROPIC_AUTH_TOKEN (sent as a bearer token) rather than ANTHROPIC_API_KEY: a key makes
    # every interactive start ask "Detected a custom API key ... use this API key?" (cursor
    # on No); a key of the user's own environment is not passed on.
    env = {"ANTHROPIC_BASE_URL": t.url, "ANTHROPIC_AUTH_TOKEN": t.key,
           **dict.fromkeys(("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                            "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                            "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"),
                           t.model),
           # its vendor's traffic off; its own side calls (titles) stay: prefixd gives them
           # their own lanes
           **dict.fromkeys(("DISABLE_AUTOUPDATER", "DISABLE_TELEMETRY",
                            "DISABLE_ERROR_REPORTING", "DISABLE_BUG_COMMAND",
                            "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY",
                            "DISABLE_INSTALLATION_CHECKS"), "1")}
    if t.window:
        # The model's window: Claude Code (2.1.197 .. 2.1.332 checked) takes it from
        # CLAUDE_CODE_MAX_CONTEXT_TOKENS for a model whose name is not "claude-*", and
        # compacts below it. CLAUDE_CODE_AUTO_COMPACT_WINDOW reads values under 100K as 100K.
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(t.window)
        if t.window >= CLAUDE_MIN_COMPACT_WINDOW:
            env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(t.window)
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(output_tokens(t.window))
    extra: list[str] = []
    if not _has_flag(args, "--settings", "--permission-mode",
                     "--dangerously-skip-permissions"):
        # auto mode (the default permission mode of current versions) asks a classifier
        # model about each tool call, and that model is the local one: switched off per run
        extra = ["--settings", json.dumps({"permissions": {"disableAutoMode": "disable"}})]
    return Launch(["claude", *extra, *args], env, unset=("ANTHROPIC_API_KEY",))


def codex(t: Target, args: list[str]) -> Launch:
    provider = (f'{{name="prefixd", base_url="{t.url}/v1", wire_api="responses", '
                f'env_key="PREFIXD_API_KEY"}}')
    config = [f"model={json.dumps(t.model)}", 'model_provider="prefixd"',
              f"model_providers.prefixd={provider}", "check_for_update_on_startup=false",
              "analytics.enabled=false", "feedback.enabled=false"]
    if t.window:
        config += [f"model_context_window={t.window}",
                   f"model_auto_compact_token_limit={t.window * 9 // 10}"]
    argv = ["codex"]
    for c in config:
        argv += ["-c", c]
    return Launch([*argv, *args], {"PREFIXD_API_KEY": t.key})


def opencode(t: Target, args: list[str]) -> Launch:
    limit = {"limit": {"context": t.window, "output": output_tokens(t.window)}} \
        if t.window else {}
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False,
              "share": "disabled", "model": f"prefixd/{t.model}",
              "small_model": f"prefixd/{t.model}",
              "provider": {"prefixd": {"npm": "@ai-sdk/openai-compatible", "name": "prefixd",
                                       "options": {"baseURL": f"{t.url}/v1", "apiKey": t.key},
                                       "models": {t.model: {"name": t.model, **limit}}}}}
    env = {"OPENCODE_CONFIG_CONTENT": json.dumps(config),
           **dict.fromkeys(("OPENCODE_DISABLE_AUTOUPDATE", "OPENCODE_DISABLE_MODELS_FETCH",
                            "OPENCODE_DISABLE_SHARE", "OPENCODE_DISABLE_LSP_DOWNLOAD"), "1")}
    return Launch(["opencode", *args], env)


def aider(t: Target, args: list[str]) -> Launch:
    # per-run flags only: `--no-analytics` (not `--analytics-disable`, which writes aider's
    # config for good). Aider fetches a price list for any model its metadata does not name,
    # and reads metadata only from a file: one in prefixd's own directory, never the user's
    # or aider's (and litellm's bundled price list, not a fetched one).
    argv = ["aider", "--openai-api-base", f"{t.url}/v1", "--model", f"openai/{t.model}",
            "--no-check-update", "--no-analytics", "--no-show-release-notes",
            "--no-show-model-warnings"]
    info: dict[str, object] = {"litellm_provider": "openai", "mode": "chat",
                               "input_cost_per_token": 0.0, "output_cost_per_token": 0.0}
    if t.window:
        info |= {"max_input_tokens": t.window, "max_tokens": output_tokens(t.window),
                 "max_output_tokens": output_tokens(t.window)}
    meta = PRIVATE / f"aider-{_safe(t.model)}-{t.window or 0}.json"
    argv += ["--model-metadata-file", str(meta)]
    return Launch([*argv, *args], {"OPENAI_API_KEY": t.key, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                  files={meta: json.dumps({f"openai/{t.model}": info})})


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]


RECIPES: dict[str, Callable[[Target, list[str]], Launch]] = {
    "claude": claude, "codex": codex, "opencode": opencode, "aider": aider}


def base_url(settings: Settings) -> str:
    host = settings.host if settings.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return f"http://{f'[{host}]' if ':' in host else host}:{settings.port}"


def served(url: str, key: str, timeout: float = 5.0) -> list[dict]:
    """prefixd's `/v1/models` entries; LaunchError when it does not answer."""
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise LaunchError(f"{url}/v1/models answered {e.code}"
                          + (" (wrong key? --api-key or PREFIXD_API_KEY)" if e.code == 401
                             else "")) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise Unreachable(f"no prefixd answers at {url} ({getattr(e, 'reason', e)}): start it "
                          "with `./run serve` or `prefixd serve`, or pass --url") from None
    entries = data.get("data") if isinstance(data, dict) else None
    return [e for e in entries or [] if isinstance(e, dict) and isinstance(e.get("id"), str)]


def pick(entries: list[dict], wanted: str | None) -> tuple[str, int | None]:
    """(model, its context window) of `wanted`, or of the only model served."""
    ids = [e["id"] for e in entries]
    if wanted is not None:
        if wanted not in ids:
            raise LaunchError(f"model {wanted!r} is not served; prefixd serves {ids}")
        entry = entries[ids.index(wanted)]
    elif len(entries) == 1:
        entry = entries[0]
    else:
        raise LaunchError(f"prefixd serves {len(ids)} models {ids}: pick one with --model"
                          if ids else "prefixd serves no model")
    window = entry.get("context_window", entry.get("context_length"))
    return entry["id"], window if isinstance(window, int) and window > 0 else None


def profile_lines(plan: Launch) -> str:
    """The plan as lines for a shell profile: its variables, then its command."""
    lines = [f"unset {k}" for k in plan.unset]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in plan.env.items()]
    lines += [f"mkdir -p {shlex.quote(str(path.parent))} && printf '%s\\n' {shlex.quote(text)} "
              f"> {shlex.quote(str(path))}" for path, text in plan.files.items()]
    return "\n".join([*lines, shlex.join(plan.argv)]) + "\n"


def write_private(files: dict[Path, str]) -> None:
    """The files a client reads, in prefixd's own directory (mode 0600)."""
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")


def wait_for_window(url: str, key: str, wanted: str | None, wait_s: float,
                    clock: Callable[[], float] = time.monotonic,
                    say: Callable[[str], None] | None = None) -> tuple[str, int | None]:
    """(model, window) once prefixd answers and knows the model's window, or its model is
    loaded and still reports none (a backend that does not say); waits at most `wait_s`,
    telling the user once what it waits for. After the wait: the window if known, else None
    (LaunchError only when prefixd never answered)."""
    say = say or (lambda m: print(f"prefixd launch: {m}", file=sys.stderr, flush=True))
    start, told = clock(), ""
    deadline = start + wait_s
    while True:
        try:
            entries = served(url, key)
        except Unreachable as e:
            # a daemon just started listens within seconds; none at all is a mistake to name
            if clock() >= min(deadline, start + UNREACHABLE_WAIT_S):
                raise LaunchError(str(e)) from None
            message = f"waiting for prefixd at {url} ..."
        else:
            model, window = pick(entries, wanted)
            state = next((e.get("state") for e in entries if e["id"] == model), None)
            if window is not None or state not in ("loading", "unloaded", None) \
                    or clock() >= deadline:
                if window is None:
                    say(f"model {model} reports no context window: the client keeps its own "
                        "default (set the backend's context_window to fix it)")
                return model, window
            message = (f"waiting up to {wait_s:.0f} s for model {model} ({state}) to report "
                       "its context window ...")
        if message != told:
            say(message)
            told = message
        time.sleep(0.5)


def run(args: argparse.Namespace, settings: Settings) -> int:
    url = (args.url or base_url(settings)).rstrip("/").removesuffix("/v1")
    key = args.api_key or (settings.api_key.get_secret_value() if settings.api_key
                           else "sk-local")
    model, window = wait_for_window(url, key, args.model, args.wait)
    plan = RECIPES[args.client](Target(url, key, model, window), list(args.client_args))
    if args.print:
        sys.stdout.write(profile_lines(plan))
        return 0
    exe = shutil.which(plan.argv[0])
    if exe is None:
        raise LaunchError(f"{plan.argv[0]} is not on PATH: install it ({INSTALL[args.client]})")
    write_private(plan.files)
    sys.stdout.flush()
    env = {k: v for k, v in os.environ.items() if k not in plan.unset}
    os.execvpe(exe, plan.argv, {**env, **plan.env})
    return 0        # not reached


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run a coding agent (claude, codex, opencode, aider) "
                       "against this prefixd, configured on its command line and environment",
                       usage="prefixd launch {aider,claude,codex,opencode} [--model M] "
                       "[--url URL] [--api-key KEY] [--print] [-- CLIENT ARGS]")
    p.add_argument("client", choices=sorted(RECIPES))
    p.add_argument("--model", help="the served model (default: the only one)")
    p.add_argument("--url", help="prefixd's base URL (default: http://HOST:PORT of the "
                   "settings)")
    p.add_argument("--api-key", help="the key to present (default: PREFIXD_API_KEY, else "
                   "sk-local)")
    p.add_argument("--env-file", help="settings file (default: ./prefixd.env if present)")
    p.add_argument("--wait", type=float, default=WAIT_S, metavar="SECONDS",
                   help="how long to wait for prefixd to answer and report the model's context "
                   f"window (default {WAIT_S:.0f})")
    p.add_argument("--print", action="store_true",
                   help="print the lines for a shell profile instead of running the client")
    p.set_defaults(client_args=[])     # what follows `--` (split off in `cli.main`)
