"""The disk tier trusts nothing it did not verify: a damaged cache file (flipped bits, random or
NaN tensors under intact token ids, a truncated file, a wrong dtype, an older format without
checksums) is a named refusal, never a state; a failed write leaves nothing behind; the files
are the daemon user's only.

Each damage case starts from one pristine cache written by a real engine (falcon_h1: full
attention KV in blocks, Mamba state in records), damages a file the next turn's restore would
read, restarts (a new Engine over the directory) and checks three things: the answer equals a
cold run's; the damaged file was refused by name (skipped at start under a reason, or a
`corrupt` miss when loaded); and it is gone from the index (and from disk unless it is a
foreign file left alone).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import stat
import subprocess
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from test_disk_tier import _cold, _engine, _run, _same, _stop, _words

from prefixd.backends.mlx.disk import chain
from prefixd.backends.mlx.disk import fmt as diskfmt
from prefixd.backends.mlx.engine.engine import Engine
from prefixd.backends.mlx.model.tiny import build_model
from prefixd.backends.mlx.scheduler.writes import hand_over

ARCH = "falcon_h1"
BASE = 300


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(ARCH, seed=3)


@pytest.fixture(scope="module")
def pristine(model: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """(a cache directory holding one finished 300-token turn, the next turn's prompt)."""
    root = tmp_path_factory.mktemp("pristine")
    base = _words(100, BASE)
    engine = _engine(model, root)
    reply = _run(engine, base, (60, 150, 220))[0]
    _stop(engine)
    return root, base + reply + _words(101, 20)


@pytest.fixture(scope="module")
def cold(model: Any, pristine: tuple[Path, list[int]]) -> tuple:
    return _cold(model, pristine[1])


def _copy(pristine: tuple[Path, list[int]], tmp_path: Path) -> tuple[Path, Path]:
    """(a copy of the pristine cache, its key directory)."""
    root = tmp_path / "cache"
    shutil.copytree(pristine[0], root)
    (key_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return root, key_dir


def _files_read(model: Any, root: Path, prompt: list[int]) -> list[Path]:
    """The files the next turn's disk restore reads (its blocks, then its record)."""
    engine = _engine(model, root)
    found = engine.tiers.disk.lookup(chain.as_tokens(prompt))
    assert found is not None
    files = engine.tiers.disk.pin(found[0])
    engine.tiers.disk.unpin(found[0])
    engine.close(5)
    return files


def _span(path: Path, name: str) -> tuple[int, int]:
    """The byte range of tensor `name`'s data in a safetensors file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    lo, hi = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return 8 + n + lo, 8 + n + hi


def _biggest(path: Path) -> str:
    """The largest non-token tensor of a file."""
    with safetensors.safe_open(str(path), framework="numpy") as f:
        names = [k for k in f.keys() if k != "tokens"]   # noqa: SIM118 - not a dict
        return max(names, key=lambda k: f.get_tensor(k).nbytes)


def _rewrite(path: Path, change: Callable[[dict[str, np.ndarray]], None],
             meta: Callable[[dict[str, str]], None] = lambda m: None) -> None:
    """Rewrite a file's tensors (and metadata) as `change` says, keeping the rest as it was:
    the checksums in its description no longer match (what bit rot or a stray writer does)."""
    with safetensors.safe_open(str(path), framework="numpy") as f:
        metadata = dict(f.metadata())
        arrays = {k: f.get_tensor(k) for k in f.keys()}   # noqa: SIM118 - not a dict
    change(arrays)
    meta(metadata)
    path.write_bytes(safetensors.numpy.save(arrays, metadata=metadata))


def _xor(path: Path, offsets: list[int], rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    for o in offsets:
        mask = rng.randrange(1, 256)
        while chr(data[o]).isspace() and chr(data[o] ^ mask).isspace():
            mask = rng.randrange(1, 256)    # JSON whitespace for whitespace: no damage at all
        data[o] ^= mask
    path.write_bytes(bytes(data))


def _refused(engine: Engine, damaged: Path, warm: tuple) -> set[str]:
    """The names the files were refused under (the damaged one, and those that needed it); the
    damaged one is out of the index, and off the disk unless it was skipped as a file of
    another kind or format, which the tier leaves alone."""
    disk = engine.tiers.disk
    info = engine.cache_info()
    assert damaged.stem not in disk.records and damaged.stem not in disk.blocks
    skipped = set(info["disk"]["skipped_files"])
    assert skipped, "the damaged file was neither skipped at start nor refused at load"
    assert skipped <= {"corrupt", "foreign", "newer_format", "format_mismatch", "missing_block"}
    if warm[2].miss == "corrupt":
        assert info["misses"] == {"corrupt": 1} and "corrupt" in skipped
    assert not damaged.exists() or skipped & {"foreign", "newer_format", "format_mismatch"}
    return skipped


# --- the two cases of the adversarial pass ----------------------------------------------------
def test_flipped_bytes_in_every_record_are_a_corrupt_miss(
        model: Any, pristine: tuple[Path, list[int]], cold: tuple, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """XOR 50 bytes inside each record's state tensor data: the restore refuses the record it
    picked (`corrupt`, counted, logged once, removed), answers as a cold run does, and what it
    writes afterwards comes from that cold state: a restart restores it and still answers
    the cold answer."""
    root, key_dir = _copy(pristine, tmp_path)
    rng = random.Random(1)
    for path in (key_dir / "records").iterdir():
        lo, hi = _span(path, _biggest(path))
        _xor(path, rng.sample(range(lo, hi), min(50, hi - lo)), rng)
    caplog.set_level(logging.INFO, logger="prefixd.worker.disk")
    engine = _engine(model, root)
    warm = _run(engine, pristine[1])
    _same(warm, cold)
    assert (warm[2].miss, warm[2].tier) == ("corrupt", None)
    assert engine.cache_info()["misses"] == {"corrupt": 1}
    lines = [r for r in caplog.records if "did not load" in r.getMessage()]
    assert len(lines) == 1 and "corrupt" in lines[0].getMessage()
    _stop(engine)
    again = _engine(model, root)
    warm = _run(again, pristine[1])
    assert warm[2].tier == "disk" and warm[2].miss is None
    _same(warm, cold)
    again.close(5)


def test_random_floats_in_two_layers_of_every_block_are_refused(
        model: Any, pristine: tuple[Path, list[int]], cold: tuple, tmp_path: Path) -> None:
    """Random floats in two full-attention layers of every block, token ids intact (the index
    accepts the blocks): the load refuses the block, and every record on it goes with it."""
    root, key_dir = _copy(pristine, tmp_path)
    rng = np.random.default_rng(2)

    def noise(arrays: dict[str, np.ndarray]) -> None:
        for name in ("1.0", "3.1"):                    # keys of layer 1, values of layer 3
            arrays[name] = rng.standard_normal(arrays[name].shape).astype(arrays[name].dtype)

    blocks = list((key_dir / "blocks").iterdir())
    assert blocks
    for path in blocks:
        _rewrite(path, noise)
    engine = _engine(model, root)
    assert engine.cache_info()["disk"]["blocks"] == len(blocks)     # the ids still check
    warm = _run(engine, pristine[1])
    _same(warm, cold)
    assert warm[2].miss == "corrupt" and warm[2].cached_tokens == 0
    disk = engine.cache_info()["disk"]
    assert disk["skipped_files"]["corrupt"] == 1 and disk["skipped_files"]["missing_block"] > 0
    assert all(b in engine.tiers.disk.blocks for r in engine.tiers.disk.records.values()
               for b in r.blocks)
    engine.close(5)


# --- fuzz -----------------------------------------------------------------------------------
def _float_tensor(path: Path) -> str:
    with safetensors.safe_open(str(path), framework="numpy") as f:
        names = [k for k in f.keys()   # noqa: SIM118 - not a dict
                 if k != "tokens" and f.get_tensor(k).dtype.kind == "f" and
                 f.get_tensor(k).size]
    return names[0]


def _damage(kind: str, path: Path, rng: random.Random) -> None:
    if kind == "flip":                          # a few bytes anywhere: header or data
        _xor(path, rng.sample(range(path.stat().st_size), rng.choice((1, 3, 20))), rng)
    elif kind == "flip_data":                   # one bit inside a tensor's data
        lo, hi = _span(path, _biggest(path))
        data = bytearray(path.read_bytes())
        data[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    elif kind == "truncate":
        path.write_bytes(path.read_bytes()[:rng.randrange(0, path.stat().st_size)])
    elif kind == "nan":
        name = _float_tensor(path)
        _rewrite(path, lambda a: a[name].reshape(-1).__setitem__(
            rng.randrange(a[name].size), np.nan))
    elif kind == "random_tensor":               # valid ids, random values, same shape/dtype
        name = _biggest(path)
        _rewrite(path, lambda a: a.__setitem__(name, np.frombuffer(
            rng.randbytes(a[name].nbytes), a[name].dtype).reshape(a[name].shape)))
    elif kind == "dtype":                       # the same bytes read as another dtype
        name = _float_tensor(path)
        _rewrite(path, lambda a: a.__setitem__(name, a[name].view(np.int32)))
    elif kind == "old_format":                  # what format 1 wrote: no checksums
        def older(m: dict[str, str]) -> None:
            desc = json.loads(m[diskfmt.META])
            desc.pop("sums")
            desc["format"] = 1
            m[diskfmt.META] = json.dumps(desc)
            del m[diskfmt.META_CRC]
        _rewrite(path, lambda a: None, older)
    elif kind == "no_sums":                     # this format, checksums stripped, CRC redone
        def stripped(m: dict[str, str]) -> None:
            desc = json.loads(m[diskfmt.META])
            desc.pop("sums")
            m[diskfmt.META] = json.dumps(desc)
            m[diskfmt.META_CRC] = str(zlib.crc32(m[diskfmt.META].encode()))
        _rewrite(path, lambda a: None, stripped)
    else:
        raise AssertionError(kind)


KINDS = ("flip", "flip_data", "truncate", "nan", "random_tensor", "dtype", "old_format",
         "no_sums")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", KINDS)
def test_fuzzed_files_are_named_refusals_and_warm_equals_cold(
        model: Any, pristine: tuple[Path, list[int]], cold: tuple, tmp_path: Path,
        kind: str, seed: int) -> None:
    root, _key_dir = _copy(pristine, tmp_path)
    files = _files_read(model, root, pristine[1])
    rng = random.Random(f"{kind}-{seed}")
    victim = files[-1] if seed == 0 else rng.choice(files)     # the record, or any of them
    _damage(kind, victim, rng)
    engine = _engine(model, root)
    warm = _run(engine, pristine[1])
    _same(warm, cold)
    reasons = _refused(engine, victim, warm)
    if kind == "old_format":
        assert "format_mismatch" in reasons
    elif kind not in ("flip", "truncate"):
        assert reasons <= {"corrupt", "missing_block"}
    engine.close(5)


# --- failed writes ----------------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs (root only; the test is skipped elsewhere), unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
            capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_disk_leaves_no_temp_file_and_no_unreferenced_block(small_fs: Path) -> None:
    """ENOSPC mid-write on a real (tiny) file system, the budget far above its size: every
    failed write removes its temp file and the blocks only it needed, `bytes_used` is what is
    on disk, and what is on disk loads as the state it claims."""
    model = build_model("qwen3", seed=3)
    engine = _engine(model, small_fs, budget=1 << 30)
    n = 0
    while engine.cache_info()["disk"]["write_errors"] < 3:
        n += 1
        assert n < 60, "the file system never filled up"
        _run(engine, _words(200 + n, 700))
        hand_over(engine, engine.lockstep, math.inf)
        assert engine.tiers.disk.drain(30.0)
    assert engine.close(5)
    (key_dir,) = [p for p in small_fs.iterdir() if p.is_dir()]
    assert not list(key_dir.rglob(".*.tmp"))
    disk = engine.tiers.disk
    on_disk = {p.stem: p.stat().st_size for p in key_dir.rglob("*" + diskfmt.SUFFIX)}
    assert set(on_disk) == set(disk.records) | set(disk.blocks)
    assert all(blk.refs > 0 for blk in disk.blocks.values())
    assert disk.bytes_used == sum(on_disk.values())
    again = _engine(model, small_fs)
    assert again.cache_info()["disk"]["skipped_files"] == {}
    again.close(5)


# --- permissions ------------------------------------------------------------------------------
def _modes(root: Path) -> set[tuple[str, int]]:
    return {("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode))
            for p in [root, *root.rglob("*")]}


def test_cache_files_are_the_daemon_users_only(model: Any, tmp_path: Path) -> None:
    """Files 0600 and directories 0700 as they are created (whatever the umask lets through),
    and those a looser version left are tightened at start."""
    base = tmp_path / "prompts"
    old = os.umask(0)
    try:
        engine = _engine(model, base)
        _run(engine, _words(300, 150))
        _stop(engine)
    finally:
        os.umask(old)
    assert _modes(base) == {("dir", 0o700), ("file", 0o600)}
    for p in base.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    base.chmod(0o755)
    _engine(model, base).close(5)
    assert _modes(base) == {("dir", 0o700), ("file", 0o600)}
