"""The daemon files in deploy/ parse, agree with each other and with the code: they run
`prefixd serve --env-file ...`, restart on failure but not on a configuration error, need no
pre-created user, and alert once per problem on metrics prefixd really exports."""

from __future__ import annotations

import plistlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefixd.metrics import REGISTRY

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def unit_sections(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values, in order]}} (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_launchd_plist_parses_and_uses_the_env_file_it_installs():
    raw = (DEPLOY / "dev.prefixd.plist").read_text()
    plist = plistlib.loads(raw.encode())
    args = plist["ProgramArguments"]
    assert args[0].endswith("/prefixd") and args[1:3] == ["serve", "--env-file"]
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["RunAtLoad"] is True
    # The install comment writes the env file where ProgramArguments reads it (launchd does
    # not expand ~, so the plist says @HOME@ and the install substitutes it).
    comment = raw[raw.index("<!--"):raw.index("-->")]
    installed = re.search(r"prefixd\.env\.example (\S+)", comment)
    assert installed, "the install comment copies the env-file example somewhere"
    assert args[3] == installed.group(1).replace("~", "@HOME@", 1)
    assert 's|@HOME@|$HOME|g' in comment
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert plist[key].startswith("@HOME@/")


def test_systemd_unit_needs_no_user_and_stops_restarting_on_config_errors():
    service = unit_sections((DEPLOY / "prefixd.service").read_text())["Service"]
    assert service["Restart"] == ["on-failure"]
    assert "2" in service["RestartPreventExitStatus"][0].split()   # cli: config error → 2
    assert service["DynamicUser"] == ["yes"] and "User" not in service
    assert service["StateDirectory"] == ["prefixd"] and service["CacheDirectory"] == ["prefixd"]
    assert service["WorkingDirectory"] == ["/var/lib/prefixd"]
    env = dict(v.split("=", 1) for v in service["Environment"])
    assert env["PREFIXD_CACHE_DIR"] == "/var/cache/prefixd"       # writable: CacheDirectory
    assert env["HOME"] == "/var/lib/prefixd"                      # writable: StateDirectory
    # The env file stays root-only; the service reads systemd's private copy of it.
    name, _, source = service["LoadCredential"][0].partition(":")
    assert source == "/etc/prefixd/prefixd.env"
    exec_start = service["ExecStart"][0]
    assert exec_start.endswith(f" serve --env-file ${{CREDENTIALS_DIRECTORY}}/{name}")


def test_systemd_unit_verifies(tmp_path):
    text = (DEPLOY / "prefixd.service").read_text()
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed")
    prefixd = Path(sys.executable).parent / "prefixd"
    unit = tmp_path / "prefixd.service"   # point ExecStart at this install so verify can stat it
    unit.write_text(text.replace(exec_line.split()[0].split("=", 1)[1], str(prefixd)))
    out = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _rules() -> dict[str, dict]:
    yaml = pytest.importorskip("yaml")
    groups = yaml.safe_load((DEPLOY / "prefixd.rules.yml").read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def test_prometheus_scrape_config_loads_the_rules():
    yaml = pytest.importorskip("yaml")
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert scrape["rule_files"] == ["prefixd.rules.yml"]
    job = scrape["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["job_name"] == "prefixd"


def test_alerts_cover_down_5xx_and_rejections_once_each():
    rules = _rules()
    assert all(r["expr"] and r["for"] and r["annotations"]["summary"] for r in rules.values())
    expr = {name: " ".join(r["expr"].split()) for name, r in rules.items()}
    assert expr["PrefixdDown"] == 'up{job="prefixd"} == 0'
    assert 'prefixd_requests_total{status=~"5.."}' in expr["PrefixdServerErrors"]
    assert 'prefixd_queue_rejected_total{reason=~"full|timeout"}' in expr["PrefixdQueueRejecting"]
    # A failed worker is one alert: PrefixdWorkerFailed, and BackendDown leaves it out.
    assert expr["PrefixdWorkerFailed"] == 'prefixd_backend_state{state="failed"} == 1'
    unless = expr["PrefixdBackendDown"].split(" unless ", 1)[1]
    assert re.search(r'state=~"[^"]*\bfailed\b', unless) and "stopped" in unless


def test_alerts_use_only_metrics_prefixd_exports():
    exported = {m.name for m in REGISTRY.collect()}
    exported |= {m.name + "_total" for m in REGISTRY.collect() if m.type == "counter"}
    for name, rule in _rules().items():
        for metric in re.findall(r"\bprefixd_\w+", rule["expr"]):
            assert metric in exported, f"{name} uses {metric}, which prefixd does not export"


def test_alert_rules_pass_promtool():
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool not installed")
    out = subprocess.run([tool, "check", "rules", str(DEPLOY / "prefixd.rules.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
