"""The daemon files in deploy/ parse and run `prefixd serve --env-file ...` with restarts."""

from __future__ import annotations

import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_launchd_plist_parses_and_restarts_on_failure():
    plist = plistlib.loads((DEPLOY / "dev.prefixd.plist").read_bytes())
    args = plist["ProgramArguments"]
    assert args[0].endswith("/prefixd") and args[1:3] == ["serve", "--env-file"]
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["RunAtLoad"] is True


def test_systemd_unit_verifies(tmp_path):
    text = (DEPLOY / "prefixd.service").read_text()
    assert "Restart=on-failure" in text
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert " serve --env-file " in exec_line
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed")
    prefixd = Path(sys.executable).parent / "prefixd"
    unit = tmp_path / "prefixd.service"   # point ExecStart at this install so verify can stat it
    unit.write_text(text.replace(exec_line.split()[0].split("=", 1)[1], str(prefixd)))
    out = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_prometheus_files_are_valid_yaml():
    yaml = pytest.importorskip("yaml")
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["metrics_path"] == "/metrics"
    rules = yaml.safe_load((DEPLOY / "prefixd.rules.yml").read_text())
    assert all(r["expr"] for g in rules["groups"] for r in g["rules"])
