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


# the engine's own rooms -> the engine rooms each may import (besides itself); the engine's
# modules beside them (`engine.py`, `run.py`, ...) may import any but `transfer`, which sits on
# the Engine
ENGINE_ROOMS = {
    "inpass": set(),
    "spec": {"inpass"},
    "live": {"inpass", "spec"},
    "batch": {"inpass", "live", "spec"},
    "transfer": {"*"},
}
ENGINE = WORKER / "engine"


def engine_rooms_imported(path: Path) -> set[str]:
    """The engine rooms (or "*": its top-level modules) a module imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:4] == ["prefixd", "backends", "mlx", "engine"] and len(parts) > 4:
                found.add(parts[4] if parts[4] in ENGINE_ROOMS else "*")
    return found


@pytest.mark.parametrize("room", sorted(ENGINE_ROOMS))
def test_engine_rooms_import_downward(room: str) -> None:
    allowed = ENGINE_ROOMS[room] | {room}
    bad = []
    for path in sorted((ENGINE / room).rglob("*.py")):
        found = engine_rooms_imported(path)
        if "*" not in allowed:
            bad += [f"{path.relative_to(ROOT)} imports engine.{b}" for b in found - allowed]
    assert bad == []


def test_nothing_in_the_engine_imports_its_transfers() -> None:
    users = [p.relative_to(ROOT) for p in ENGINE.rglob("*.py") if "transfer" not in p.parts
             and "transfer" in engine_rooms_imported(p)]
    assert users == []


def test_every_engine_room_says_what_it_owns() -> None:
    rooms = {p.name for p in ENGINE.iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(ENGINE_ROOMS)
    for room in rooms:
        assert (ENGINE / room / "__init__.py").read_text().startswith('"""'), room


def module_graph(root: Path) -> dict[str, set[str]]:
    """Every module under `root` -> the modules under it that it imports (a lazy or
    TYPE_CHECKING import counts: a reader follows it all the same)."""
    mods: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(("prefixd", *rel.parts)).removesuffix(".__init__")
        mods[name] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    target = full if full in mods else node.module
                    if target in mods and target != name:
                        graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_worker_has_no_import_circle() -> None:
    assert cycles(module_graph(WORKER)) == []


def test_the_circle_check_sees_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_folder_under_backends_holds_more_than_15_modules() -> None:
    crowded = {str(d.relative_to(ROOT)): n for d in [ROOT / "backends",
                                                    *(ROOT / "backends").rglob("*")]
               if d.is_dir() and (n := len(list(d.glob("*.py")))) > 15}
    assert crowded == {}
