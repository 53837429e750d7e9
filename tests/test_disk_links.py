"""The disk tier's start-up walk never follows or creates a link, and no one bad entry switches
the tier off (issue 33 item 4): a link where a record, a block, `manifest.json`, `lock` or a
directory belongs is removed (the link, never its target: the target's mode and bytes stay)
and counted `foreign`; a directory or a FIFO where a record belongs is counted and stepped
around, and every other record still restores.

Each case damages a copy of one real cache (qwen3, written by a real engine) and restarts: a
new Engine over the directory, as a worker's start-up is."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from test_disk_tier import _engine, _run, _stop, _words

from prefixd.backends.mlx.disk import chain
from prefixd.backends.mlx.disk import fmt as diskfmt
from prefixd.backends.mlx.engine.engine import Engine
from prefixd.backends.mlx.model.tiny import build_model


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model("qwen3", seed=3)


@pytest.fixture(scope="module")
def pristine(model: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """(a cache holding two conversations' finished turns, each one's next prompt)."""
    root = tmp_path_factory.mktemp("pristine")
    engine = _engine(model, root)
    nexts = []
    for seed in (1, 2):
        base = _words(seed, 200)
        nexts.append(base + _run(engine, base)[0] + _words(seed + 50, 10))
    _stop(engine)
    return root, nexts


@pytest.fixture
def cache(pristine: tuple[Path, list[list[int]]], tmp_path: Path) -> tuple[Path, Path]:
    """(a copy of the pristine cache, its key directory)."""
    root = tmp_path / "cache"
    shutil.copytree(pristine[0], root, symlinks=True)
    (key_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return root, key_dir


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of the user's outside the cache, readable by others (0644)."""
    path = tmp_path / "victim.txt"
    path.write_text("the user's own file\n")
    path.chmod(0o644)
    return path


def _restart(model: Any, root: Path) -> Engine:
    """A worker's start-up over `root`, bounded: a walk that blocks (a FIFO opened for
    reading) fails the test instead of hanging it."""
    out: list[Engine] = []
    t = threading.Thread(target=lambda: out.append(_engine(model, root)), daemon=True)
    t.start()
    t.join(120)
    assert out, "the disk tier's start-up walk did not finish"
    return out[0]


def _restores(engine: Engine, prompt: list[int]) -> bool:
    return engine.tiers.disk.lookup(chain.as_tokens(prompt)) is not None


def _records(key_dir: Path) -> list[Path]:
    return sorted((key_dir / "records").glob("*" + diskfmt.SUFFIX))


def _check_untouched(victim: Path) -> None:
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert victim.read_text() == "the user's own file\n"


@pytest.mark.parametrize("kind", ["record", "block"])
def test_a_file_linked_to_another_file_is_removed_and_the_file_untouched(
        model: Any, cache: tuple[Path, Path], victim: Path, pristine: tuple, kind: str) -> None:
    root, key_dir = cache
    link = (_records(key_dir)[0] if kind == "record"
            else sorted((key_dir / "blocks").glob("*" + diskfmt.SUFFIX))[0])
    link.unlink()
    link.symlink_to(victim)
    engine = _restart(model, root)
    try:
        _check_untouched(victim)
        assert not os.path.lexists(link)
        assert engine.cache_info()["disk"]["skipped_files"].get("foreign") == 1
        if kind == "record":
            assert any(_restores(engine, p) for p in pristine[1])     # the tier is on
    finally:
        engine.close(5)


@pytest.mark.parametrize("name", ["manifest.json", "lock"])
def test_a_link_to_a_missing_path_creates_nothing(model: Any, cache: tuple[Path, Path],
                                                  tmp_path: Path, pristine: tuple,
                                                  name: str) -> None:
    root, key_dir = cache
    target = tmp_path / f"created-through-{name}"
    (key_dir / name).unlink()
    (key_dir / name).symlink_to(target)
    engine = _restart(model, root)
    try:
        assert not os.path.lexists(target)
        assert not (key_dir / name).is_symlink() and (key_dir / name).is_file()
        assert stat.S_IMODE((key_dir / name).stat().st_mode) == 0o600
        assert engine.cache_info()["disk"]["skipped_files"].get("foreign") == 1
        assert all(_restores(engine, p) for p in pristine[1])
    finally:
        engine.close(5)


def test_a_linked_manifest_to_a_file_leaves_the_file_alone(
        model: Any, cache: tuple[Path, Path], victim: Path) -> None:
    root, key_dir = cache
    (key_dir / "manifest.json").unlink()
    (key_dir / "manifest.json").symlink_to(victim)
    _restart(model, root).close(5)
    _check_untouched(victim)
    assert (key_dir / "manifest.json").is_file() and not (key_dir / "manifest.json").is_symlink()


@pytest.mark.parametrize("sub", ["records", "blocks"])
def test_a_linked_directory_is_replaced_and_its_target_untouched(
        model: Any, cache: tuple[Path, Path], tmp_path: Path, victim: Path,
        sub: str) -> None:
    root, key_dir = cache
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(key_dir / sub), elsewhere)
    elsewhere.chmod(0o755)
    shutil.copy(victim, elsewhere / ("0" * 32 + diskfmt.SUFFIX))
    (elsewhere / ("0" * 32 + diskfmt.SUFFIX)).chmod(0o644)
    before = sorted(p.name for p in elsewhere.iterdir())
    (key_dir / sub).symlink_to(elsewhere, target_is_directory=True)
    engine = _restart(model, root)
    try:
        assert (key_dir / sub).is_dir() and not (key_dir / sub).is_symlink()
        assert sorted(p.name for p in elsewhere.iterdir()) == before      # nothing deleted
        assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755
        assert stat.S_IMODE((elsewhere / ("0" * 32 + diskfmt.SUFFIX)).stat().st_mode) == 0o644
        assert engine.cache_info()["disk"]["skipped_files"].get("foreign") == 1
    finally:
        engine.close(5)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_directory_or_fifo_where_a_record_belongs_keeps_the_tier_on(
        model: Any, cache: tuple[Path, Path], pristine: tuple, kind: str) -> None:
    """Counted foreign, never opened (a FIFO froze the old walk), the tier stays on."""
    root, key_dir = cache
    records = _records(key_dir)
    gone = records[0]
    gone.unlink()
    if kind == "directory":
        gone.mkdir()
        (gone / "inside").write_text("x")
    else:
        os.mkfifo(gone)
    engine = _restart(model, root)
    try:
        assert engine.tiers.disk is not None
        assert engine.cache_info()["disk"]["skipped_files"].get("foreign") == 1
        assert engine.cache_info()["disk"]["records"] == len(records) - 1
        assert any(_restores(engine, p) for p in pristine[1])
        if kind == "directory":
            assert (gone / "inside").read_text() == "x"           # counted, left alone
    finally:
        engine.close(5)


def test_a_linked_tier_directory_is_replaced(model: Any, cache: tuple[Path, Path],
                                             tmp_path: Path, victim: Path) -> None:
    """The key directory itself a link (to a directory holding the user's file): the link
    goes, a fresh tier starts, the target keeps its file and mode."""
    root, key_dir = cache
    elsewhere = tmp_path / "other-dir"
    elsewhere.mkdir(mode=0o755)
    shutil.copy(victim, elsewhere / "victim.txt")
    shutil.rmtree(key_dir)
    key_dir.symlink_to(elsewhere, target_is_directory=True)
    engine = _restart(model, root)
    try:
        assert key_dir.is_dir() and not key_dir.is_symlink()
        assert sorted(p.name for p in elsewhere.iterdir()) == ["victim.txt"]
        assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755
        assert engine.tiers.disk is not None
    finally:
        engine.close(5)


def test_a_hard_linked_record_is_removed_and_the_other_name_untouched(
        model: Any, cache: tuple[Path, Path], tmp_path: Path, victim: Path,
        pristine: tuple) -> None:
    """A record that is a hard link to the user's file (one inode, two names): the mode is
    never set through it; the cache's name goes, the user's file stays as it was."""
    root, key_dir = cache
    record = _records(key_dir)[0]
    record.unlink()
    os.link(victim, record)
    engine = _restart(model, root)
    try:
        _check_untouched(victim)
        assert not os.path.lexists(record)
        assert engine.cache_info()["disk"]["skipped_files"].get("foreign") == 1
        assert any(_restores(engine, p) for p in pristine[1])
    finally:
        engine.close(5)


def test_a_linked_prompts_directory_is_replaced(model: Any, cache: tuple[Path, Path],
                                                tmp_path: Path, victim: Path) -> None:
    """`<cache_dir>/prompts` itself a link to another directory: neither that directory's
    mode nor its files change; a real `prompts` takes the link's place."""
    prompts = tmp_path / "cache_dir" / "prompts"
    prompts.parent.mkdir()
    elsewhere = tmp_path / "users-dir"
    elsewhere.mkdir(mode=0o755)
    shutil.copy(victim, elsewhere / "victim.txt")
    prompts.symlink_to(elsewhere, target_is_directory=True)
    engine = _restart(model, prompts)
    try:
        assert prompts.is_dir() and not prompts.is_symlink()
        assert sorted(p.name for p in elsewhere.iterdir()) == ["victim.txt"]
        assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755
        assert engine.cache_info()["disk"]["skipped_files"].get("foreign") == 1
    finally:
        engine.close(5)


def test_a_link_of_any_name_in_the_tier_is_removed_unfollowed(
        model: Any, cache: tuple[Path, Path], victim: Path, tmp_path: Path) -> None:
    """Links the tier has no use for (beside its files, to a file and to a directory) are
    removed too, never followed: their targets keep their modes and contents."""
    root, key_dir = cache
    (key_dir / "notes.txt").symlink_to(victim)
    elsewhere = tmp_path / "dir-elsewhere"
    elsewhere.mkdir(mode=0o755)
    (key_dir / "more").symlink_to(elsewhere, target_is_directory=True)
    engine = _restart(model, root)
    try:
        _check_untouched(victim)
        assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755
        assert not os.path.lexists(key_dir / "notes.txt")
        assert not os.path.lexists(key_dir / "more")
        assert engine.cache_info()["disk"]["skipped_files"].get("foreign") == 2
    finally:
        engine.close(5)
