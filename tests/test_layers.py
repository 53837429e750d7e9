"""The layers import downward only: proxy → backends → api; metrics and api are leaves.

Read from the source (ast), so a lazy import inside a function counts as much as a top one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package folder -> prefixd packages it may import (besides itself)
ALLOWED = {
    "api": set(),
    "metrics": set(),
    "backends": {"api", "metrics"},
    "proxy": {"api", "backends", "metrics"},
}


def imports(path: Path) -> set[str]:
    """The prefixd top-level packages a module imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = ([f"prefixd.{a.name}" for a in node.names] if node.module == "prefixd"
                     else [node.module])
        for name in names:
            parts = name.split(".")
            if parts[0] == "prefixd":
                found.add(parts[1] if len(parts) > 1 else "")
    return found


def violations(package: str) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imports(path) - ALLOWED[package] - {package}
        out += [f"{path.relative_to(ROOT)} imports prefixd.{b}" for b in sorted(bad)]
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package: str) -> None:
    assert violations(package) == []


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from prefixd.proxy.settings import Settings\n")
    assert imports(bad) == {"proxy"}
