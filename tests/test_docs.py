"""Docs that are generated from code stay in step with it, the README's first screen gives a
newcomer the two commands CI runs, and every link between the docs leads somewhere."""

import re
from pathlib import Path

from prefixd.proxy import docgen
from prefixd.proxy.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FIRST_SCREEN = 40


def test_configuration_reference_and_env_example_match_settings():
    reference = docgen.REFERENCE.read_text()
    assert reference == docgen.render_reference(reference), \
        "docs/CONFIGURATION.md is stale: python -m prefixd.proxy.docgen --write"
    assert docgen.ENV_EXAMPLE.read_text() == docgen.env_example(), \
        "deploy/prefixd.env.example is stale: python -m prefixd.proxy.docgen --write"
    for name in Settings.model_fields:
        assert f"PREFIXD_{name.upper()}" in reference


def test_every_setting_is_described():
    missing = [n for n, f in Settings.model_fields.items() if not f.description]
    assert not missing


def test_readme_opens_with_the_two_commands_ci_runs():
    lines = README.read_text().splitlines()
    for command in ("./run serve", "./run test"):
        assert command in [line.strip() for line in lines[:FIRST_SCREEN]], command
    assert "./run test" in (ROOT / ".ci" / "run").read_text()
    assert len(lines) < 250, "the README is an entry point: move the detail into docs/"


def _prose(text: str) -> str:
    """Markdown without its fenced code blocks (a link in a code sample is not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, a
    repeated heading numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _prose(doc.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen[f"{slug}-{n}"] = 1
    return set(seen)


def test_every_link_leads_somewhere():
    broken = []
    for doc in DOCS:
        text = _prose(doc.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):            # http(s):, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists() or (anchor and dest.suffix == ".md"
                                     and anchor not in _anchors(dest)):
                broken.append(f"{doc.name}: {target}")
        for path in re.findall(r"`(docs/[\w./-]+)`", text):   # paths from the repository root
            if not (ROOT / path).exists():
                broken.append(f"{doc.name}: {path}")
    assert not broken
