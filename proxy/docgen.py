"""Generate the configuration reference (docs/CONFIGURATION.md) and `deploy/prefixd.env.example`
from the Settings field descriptions, so the docs cannot drift from the code.

    python -m prefixd.proxy.docgen          # check: exit 1 if a generated file is stale
    python -m prefixd.proxy.docgen --write  # rewrite them
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from prefixd.proxy.settings import BackendConfig, Settings

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "CONFIGURATION.md"
ENV_EXAMPLE = ROOT / "deploy" / "prefixd.env.example"
START, END = "<!-- settings:start -->", "<!-- settings:end -->"
BSTART, BEND = "<!-- backend-fields:start -->", "<!-- backend-fields:end -->"


def _default(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]  # settings' factories take no data
    return info.default


def _show(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def settings_table() -> str:
    rows = ["| variable | default | description |", "|---|---|---|"]
    for name, info in Settings.model_fields.items():
        default = _show(_default(info)).replace("|", "\\|")
        desc = (info.description or "").replace("|", "\\|")
        rows.append(f"| `PREFIXD_{name.upper()}` | `{default}` | {desc} |")
    return "\n".join(rows)


def backend_table() -> str:
    rows = ["| field | default | description |", "|---|---|---|"]
    for name, info in BackendConfig.model_fields.items():
        default = "required" if info.is_required() else _show(_default(info))
        rows.append(f"| `{name}` | `{default}` | {info.description or ''} |")
    return "\n".join(rows)


def env_example() -> str:
    out = ["# prefixd settings: every variable with its default. Copy to prefixd.env (or pass",
           "# --env-file) and uncomment what you change. Generated from proxy/settings.py by",
           "# `python -m prefixd.proxy.docgen --write`; a test keeps it in step.", ""]
    for name, info in Settings.model_fields.items():
        out.append(f"# {info.description}")
        out.append(f"# PREFIXD_{name.upper()}={_show(_default(info))}")
        out.append("")
    return "\n".join(out)


def _splice(text: str, start: str, end: str, body: str) -> str:
    a, b = text.index(start) + len(start), text.index(end)
    return text[:a] + "\n" + body + "\n" + text[b:]


def render_reference(text: str) -> str:
    return _splice(_splice(text, START, END, settings_table()), BSTART, BEND, backend_table())


def main(argv: list[str] | None = None) -> int:
    write = "--write" in (sys.argv[1:] if argv is None else argv)
    stale = []
    for path, want in ((REFERENCE, render_reference(REFERENCE.read_text())),
                       (ENV_EXAMPLE, env_example())):
        have = path.read_text() if path.exists() else ""
        if have != want:
            stale.append(path)
            if write:
                path.write_text(want)
    if stale and not write:
        print("stale: " + ", ".join(map(str, stale)) + " (run with --write)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
