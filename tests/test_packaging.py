"""A wheel of prefixd holds what the code needs, and installing it prints no warning.

pyproject.toml maps each package from a top-level folder (`prefixd.proxy` is `proxy/`), so
setuptools cannot find packages itself: every folder of package files is listed by hand. A
folder left out is missing from a non-editable install (the import fails there, never in the
editable checkout), and a listed folder's data files ship only if a package-data glob names them.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from prefixd.proxy.ui import STATIC, TYPES

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PROJECT["tool"]["setuptools"]


def package_folders() -> dict[str, Path]:
    """Package name -> folder, for every folder under a mapped package that holds files."""
    found = {}
    for top, rel in SETUPTOOLS["package-dir"].items():
        base = ROOT / rel
        for folder in [base, *base.rglob("*")]:
            if (folder.is_dir() and "__pycache__" not in folder.parts
                    and any(f.is_file() for f in folder.iterdir())):
                found[".".join([top, *folder.relative_to(base).parts])] = folder
    return found


def test_license_is_an_spdx_string():
    """A TOML table is deprecated (setuptools warns three times per install); the string form
    needs setuptools 77."""
    assert isinstance(PROJECT["project"]["license"], str)
    (least,) = (m[1] for r in PROJECT["build-system"]["requires"]
                if (m := re.match(r"setuptools>=(\d+)", r)))
    assert int(least) >= 77


def test_every_folder_of_package_files_is_listed():
    assert sorted(package_folders()) == sorted(SETUPTOOLS["packages"])


def test_every_data_file_ships():
    data = SETUPTOOLS["package-data"]
    for name, folder in package_folders().items():
        files = {f.name for f in folder.iterdir() if f.is_file() and f.suffix != ".py"}
        shipped = {f.name for pattern in data.get(name, []) for f in folder.glob(pattern)}
        assert files <= shipped, f"{name}: {sorted(files - shipped)} not in package-data"


def test_every_kind_of_file_the_status_page_serves_ships():
    folder = package_folders()["prefixd.proxy.ui.static"]
    assert folder == STATIC and (STATIC / "index.html").is_file()
    assert sorted(SETUPTOOLS["package-data"]["prefixd.proxy.ui.static"]) == sorted(
        "*" + suffix for suffix in TYPES)
