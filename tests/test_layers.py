"""The layers import downward only: proxy → backends → api; metrics and api are leaves. Inside
the mlx worker, its rooms do the same (server → scheduler → grammar, engine → disk → cache; see
`backends/mlx/__init__.py`).

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
    "kvevents": set(),
    "backends": {"api", "kvevents", "metrics"},
    "proxy": {"api", "backends", "kvevents", "metrics"},
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


# the worker's rooms -> the rooms each may import (besides itself); `settings.py` beside them
# is open to all (it imports no room), `__main__.py` is the process and may import any
ROOMS = {
    "cache": set(),
    "chat": {"cache"},
    "group": set(),
    "model": set(),
    "disk": {"cache"},
    "events": {"cache", "disk"},
    "grammar": {"chat"},
    "engine": {"cache", "chat", "disk", "group", "model"},
    "scheduler": {"cache", "chat", "engine", "events", "grammar", "group", "model"},
    "server": {"cache", "chat", "engine", "grammar", "model", "scheduler"},
}
WORKER = ROOT / "backends" / "mlx"


def rooms_imported(path: Path) -> set[str]:
    """The worker rooms (and top-level modules) a module imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = ([f"{node.module}.{a.name}" for a in node.names]
                     if node.module == "prefixd.backends.mlx" else [node.module])
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:3] == ["prefixd", "backends", "mlx"] and len(parts) > 3:
                found.add(parts[3])
    return found


def room_violations(room: str) -> list[str]:
    out = []
    for path in sorted((WORKER / room).rglob("*.py")):
        bad = rooms_imported(path) - ROOMS[room] - {room, "settings"}
        out += [f"{path.relative_to(ROOT)} imports backends.mlx.{b}" for b in sorted(bad)]
    return out


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_worker_rooms_import_downward(room: str) -> None:
    assert room_violations(room) == []


def test_every_worker_module_lives_in_a_room() -> None:
    """Beside the rooms only the package's docstring, the process and its settings."""
    loose = {p.name for p in WORKER.glob("*.py")}
    assert loose == {"__init__.py", "__main__.py", "settings.py"}
    assert {p.name for p in WORKER.iterdir() if (p / "__init__.py").exists()} == set(ROOMS)
    for room in ROOMS:
        assert (WORKER / room / "__init__.py").read_text().startswith('"""'), room


def test_the_room_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from prefixd.backends.mlx import scheduler\n"
                   "from prefixd.backends.mlx.server.app import build\n")
    assert rooms_imported(bad) == {"scheduler", "server"}


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
