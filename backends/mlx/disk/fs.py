"""The disk tier's file-system entries, never through a link: every name in a tier's directory
is looked at with `lstat` and opened with `O_NOFOLLOW`, so a symbolic link planted there (to
another file, to a missing path, to a directory elsewhere) is never read, written, created
through or made private; it is removed (the link, never its target) and counted as a
`foreign` entry. An entry of the wrong type where the tier needs its own (a directory or a
FIFO where a record, `manifest.json` or `lock` belongs) is counted and stepped around or
replaced; it never switches the tier off.

Owns: what kind an entry is (`kind`), making a directory or file name the tier's own
(`claim_dir`, `claim_file`), tightening a regular file's mode through its own descriptor
(`private_file`), opening a file for the tier without following a link (`open_nofollow`), and
the lock that makes one process a directory's only user (`own`).
"""

from __future__ import annotations

import collections
import os
import shutil
import stat
from pathlib import Path
from typing import IO, Literal

FILE_MODE, DIR_MODE = 0o600, 0o700
Kind = Literal["missing", "file", "dir", "link", "other"]
Counter = collections.Counter[str]


def kind(path: Path) -> Kind:
    """What `path` itself is (a link is a link, whatever it points to)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISREG(mode):
        return "file"
    return "dir" if stat.S_ISDIR(mode) else "other"


def remove(path: Path, what: Kind, skipped: Counter) -> None:
    """Remove an entry that is not the tier's (a link itself, never its target; a directory
    with what is in it, links inside removed as links), counted as `foreign`."""
    skipped["foreign"] += 1
    if what == "dir":
        shutil.rmtree(path, ignore_errors=True)      # never follows links (fd-based)
    else:
        path.unlink(missing_ok=True)


def claim_dir(path: Path, skipped: Counter) -> None:
    """Make `path` a real directory, the daemon user's only: whatever else has the name (a
    link, a file, a FIFO) is removed and counted first."""
    what = kind(path)
    if what not in ("missing", "dir"):
        remove(path, what, skipped)
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    if kind(path) != "dir":            # replaced meanwhile: not ours to use
        raise NotADirectoryError(f"{path} is not a directory")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != DIR_MODE:
            os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def claim_file(path: Path, skipped: Counter) -> None:
    """Clear the name of a file the tier creates itself (`manifest.json`, `lock`): anything
    there but a regular file of its own (a link, a hard link to another name, a directory, a
    FIFO) is removed and counted."""
    what = kind(path)
    if what == "file" and os.lstat(path).st_nlink != 1:
        what = "link"
    if what not in ("missing", "file"):
        remove(path, what, skipped)


def open_nofollow(path: Path, flags: int) -> int:
    """A descriptor of the regular file `path` (created 0600 with O_CREAT), never through a
    link (OSError ELOOP) and never blocking on a FIFO (OSError if it is not a regular file)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_file(path: Path) -> bool:
    """Make the regular file `path` mode 0600, through its own descriptor (never a link's
    target); False, changing nothing, when it is a hard link (another name shares its inode:
    not a file the tier wrote, which renames each into place once)."""
    fd = open_nofollow(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_nlink != 1:
            return False
        if stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
        return True
    finally:
        os.close(fd)


def entries(directory: Path) -> list[tuple[Path, Kind]]:
    """The entries of `directory` by name, each with its own kind (not followed)."""
    out: list[tuple[Path, Kind]] = []
    with os.scandir(directory) as it:
        for e in it:
            if e.is_symlink():
                what: Kind = "link"
            elif e.is_file(follow_symlinks=False):
                what = "file"
            elif e.is_dir(follow_symlinks=False):
                what = "dir"
            else:
                what = "other"
            out.append((Path(e.path), what))
    return sorted(out)


class DirectoryInUse(OSError):
    """Another live worker owns this cache directory."""


def own(root: Path, skipped: Counter) -> IO[str]:
    """Hold an exclusive lock on the directory for this process's life (the OS drops it when
    the process dies, SIGKILL included): one writer and one index per directory, so budgets
    and evictions never fight. A second worker of the same model runs without a disk tier."""
    import fcntl

    claim_file(root / "lock", skipped)
    f = os.fdopen(open_nofollow(root / "lock", os.O_RDWR | os.O_CREAT), "a+")
    if os.fstat(f.fileno()).st_mode & 0o777 != FILE_MODE:
        os.fchmod(f.fileno(), FILE_MODE)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        raise DirectoryInUse(f"{root} is in use by another worker") from e
    return f

