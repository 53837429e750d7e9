"""`prefixd launch claude|codex|opencode|aider [--model M] [--print] [-- client args]`: run a
coding agent against a running prefixd with nothing set by hand.

It asks prefixd which models it serves (`GET /v1/models`): the only one, or `--model`; and that
model's context window where prefixd knows it. Then it gives the client, through its
environment and command-line overrides only (the user's own config files are never written;
what a client can only read from a file goes into prefixd's private directory), the base URL,
the key, the model for every role (Claude Code's small/fast and sub-agent models too), the
window to compact at, and every switch it has to stop update checks, telemetry, error reports
and other calls to its vendor; then it execs the client. `--print` shows the lines for a shell
profile instead.

Owns: the per-client recipes (`RECIPES`), pure functions of a `Target`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
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
PRIVATE = Path("~/.cache/prefixd/launch").expanduser()


class LaunchError(Exception):
    """A launch that cannot go ahead, in one line a user can act on."""


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
    files: dict[Path, str] = field(default_factory=dict)    # private files the client reads


def claude(t: Target, args: list[str]) -> Launch:
    env = {"ANTHROPIC_BASE_URL": t.url, "ANTHROPIC_API_KEY": t.key,
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
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(t.window)
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max(1024, t.window // 4))
    return Launch(["claude", *args], env)


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
    limit = {"limit": {"context": t.window, "output": max(1024, t.window // 4)}} \
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
    argv = ["aider", "--openai-api-base", f"{t.url}/v1", "--model", f"openai/{t.model}",
            "--no-check-update", "--analytics-disable", "--no-show-release-notes",
            "--no-show-model-warnings"]
    files = {}
    if t.window:
        meta = PRIVATE / "aider-model-metadata.json"
        files[meta] = json.dumps({f"openai/{t.model}": {
            "max_input_tokens": t.window, "max_tokens": max(1024, t.window // 4),
            "max_output_tokens": max(1024, t.window // 4), "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0, "litellm_provider": "openai", "mode": "chat"}})
        argv += ["--model-metadata-file", str(meta)]
    return Launch([*argv, *args], {"OPENAI_API_KEY": t.key}, files)


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
        raise LaunchError(f"no prefixd answers at {url} ({getattr(e, 'reason', e)}): start it "
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
    lines = [f"export {k}={shlex.quote(v)}" for k, v in plan.env.items()]
    lines += [f"# written by prefixd launch: {path}" for path in plan.files]
    return "\n".join([*lines, shlex.join(plan.argv)]) + "\n"


def write_private(files: dict[Path, str]) -> None:
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_text(text)
        path.chmod(0o600)


def run(args: argparse.Namespace, settings: Settings) -> int:
    url = (args.url or base_url(settings)).rstrip("/").removesuffix("/v1")
    key = args.api_key or (settings.api_key.get_secret_value() if settings.api_key
                           else "sk-local")
    model, window = pick(served(url, key), args.model)
    plan = RECIPES[args.client](Target(url, key, model, window), list(args.client_args))
    write_private(plan.files)
    if args.print:
        sys.stdout.write(profile_lines(plan))
        return 0
    exe = shutil.which(plan.argv[0])
    if exe is None:
        raise LaunchError(f"{plan.argv[0]} is not on PATH: install it ({INSTALL[args.client]})")
    sys.stdout.flush()
    os.execvpe(exe, plan.argv, {**os.environ, **plan.env})
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
    p.add_argument("--print", action="store_true",
                   help="print the lines for a shell profile instead of running the client")
    p.set_defaults(client_args=[])     # what follows `--` (split off in `cli.main`)
