"""docs/ARCHITECTURE.md is the map: every module of the packages it maps is named on it, in its
package's row or section, so a newcomer finds each file from the page.

A module is named by a code span in the page: its path from the repository's root anywhere,
or its path from the package whose row or section the span is in. The sections are the
`**`pkg/`**` paragraphs (up to the next one or the next heading), the layer bullets
(`- `api` — ...`), a table row whose first cell is a folder (`| `engine/` | ...`, inside the
section of the package that holds it) and the headings that are about one package
(`HEADINGS`). A package (`__init__.py`) is named by its folder.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("api", "backends", "kvevents", "metrics", "proxy")
HEADINGS = {"The request pipeline": "proxy/"}       # its stage table names `stages/parse.py`
SPAN = re.compile(r"`([^`\s]+)`")
FOLDER = r"`([\w/]+/)`"


def named(text: str) -> set[str]:
    """Every path (from the repository's root) a code span of `text` names."""
    found: set[str] = set()
    section = item = ""
    for line in text.splitlines():
        if line.startswith("#"):
            section, item = HEADINGS.get(line.lstrip("#").strip(), ""), ""
            continue
        if m := re.match(rf"\*\*{FOLDER}\*\*", line):
            section = m[1]
        if m := re.match(r"- `(\w+)` —", line):
            item = m[1] + "/"
        elif not line.startswith("  "):
            item = ""
        base = item or section
        if line.startswith("|") and (m := re.fullmatch(FOLDER, line.split("|")[1].strip())):
            base = section + m[1]
            found.add(base)
        for span in SPAN.findall(line):
            found |= {base + span, span}
    return {p.rstrip("/") for p in found}


def modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def unnamed(text: str) -> list[str]:
    names = named(text)
    return [m for m in modules()
            if (m.removesuffix("/__init__.py") if m.endswith("/__init__.py") else m) not in names]


def test_every_module_is_named_on_the_map() -> None:
    assert unnamed(DOC.read_text()) == []


def test_every_code_span_ends_on_its_line() -> None:
    """A span broken over two lines would be read as no name at all."""
    text = re.sub(r"^```.*?^```", "", DOC.read_text(), flags=re.M | re.S)
    assert [line for line in text.splitlines() if line.count("`") % 2] == []


def test_a_name_counts_in_its_own_package_only() -> None:
    text = ("## Packages\n\n**`backends/mlx/`** is the worker.\n\n"
            "| room | owns | its modules |\n|---|---|---|\n"
            "| `engine/` | one model | `engine.py`, `spec/draft.py` |\n\n"
            "**`proxy/`** owns `queue.py`.\n\n## Layers\n\n- `api` — the wire (`errors.py`),\n"
            "  the schema (`schema.py`).\n- `metrics` — declared once.\n")
    got = named(text)
    assert {"backends/mlx/engine/engine.py", "backends/mlx/engine/spec/draft.py",
            "proxy/queue.py", "api/errors.py", "api/schema.py", "api", "backends/mlx"} <= got
    assert not {"backends/mlx/engine.py", "backends/mlx/queue.py", "proxy/errors.py",
                "metrics/schema.py"} & got
