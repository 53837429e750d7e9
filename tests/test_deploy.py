"""The daemon files in deploy/ parse, agree with each other and with the code: they run
`prefixd serve --env-file ...`, restart on failure but not on a configuration error, need no
pre-created user, and alert once per problem on metrics prefixd really exports. The Kubernetes
manifests (deploy/kubernetes/) run `prefixd picker` with the flags, port, health names and
settings the code has, mount the endpoints file the settings name, and route the Gateway's
traffic to the InferencePool whose picker that is."""

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


# --- deploy/kubernetes: `prefixd picker` as an InferencePool's endpoint picker ------------------
KUBE = DEPLOY / "kubernetes"


def _manifests() -> dict[tuple[str, str], dict]:
    """Every object of deploy/kubernetes/*.yaml by (kind, name)."""
    yaml = pytest.importorskip("yaml")
    objects = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None and doc.get("kind") != "Kustomization":
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def _picker_container(objects: dict[tuple[str, str], dict]) -> dict:
    pod = objects[("Deployment", "prefixd-picker")]["spec"]["template"]["spec"]
    return pod["containers"][0]


def test_kubernetes_manifests_parse_and_the_kustomization_lists_them():
    yaml = pytest.importorskip("yaml")
    objects = _manifests()
    assert {kind for kind, _ in objects} == {"ConfigMap", "Deployment", "Service", "InferencePool",
                                            "HTTPRoute", "Gateway"}
    listed = yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"]
    assert all((KUBE / f).is_file() for f in listed)
    assert set(listed) == {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml",
                                                                    "gateway.yaml"}


def test_the_picker_container_runs_the_cli_on_the_port_the_pool_and_probes_use(tmp_path,
                                                                               monkeypatch):
    from prefixd.proxy.cli import build_parser, load_settings
    from prefixd.proxy.settings import Settings

    server = pytest.importorskip("prefixd.proxy.picker.server")   # the gateway extra
    objects = _manifests()
    container = _picker_container(objects)
    assert container["command"] == ["prefixd"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "picker" and args.host == "0.0.0.0"
    # the container's settings: its ConfigMap as environment, no env file, the args on top
    # (as `prefixd picker` builds them)
    for key, value in objects[("ConfigMap", "prefixd-picker-settings")]["data"].items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    settings = load_settings(args.env_file, host=args.host, picker_port=args.port,
                             picker_endpoints_file=args.endpoints)
    port = settings.picker_port
    assert port == Settings.model_fields["picker_port"].default == 9002
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == port and ports["metrics"] == settings.picker_metrics_port
    for probe, name in (("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
        assert container[probe]["grpc"] == {"port": port, "service": name}
        assert name in server.HEALTH_NAMES
    service = objects[("Service", "prefixd-picker")]["spec"]
    grpc = next(p for p in service["ports"] if p["targetPort"] == "grpc")
    assert grpc["port"] == port and grpc["appProtocol"] == "kubernetes.io/h2c"
    pod = objects[("Deployment", "prefixd-picker")]["spec"]["template"]
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    ref = objects[("InferencePool", "qwen3-pool")]["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["port"]["number"]) == ("Service", "prefixd-picker", port)
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    # answers under way may finish before the pod is killed
    assert pod["spec"]["terminationGracePeriodSeconds"] > settings.shutdown_timeout_s


def test_the_endpoints_configmap_is_the_file_the_settings_name():
    from prefixd.proxy.picker.endpoints import from_file

    objects = _manifests()
    settings = objects[("ConfigMap", "prefixd-picker-settings")]["data"]
    container = _picker_container(objects)
    pod = objects[("Deployment", "prefixd-picker")]["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v.get("configMap", {}).get("name")
                  == "prefixd-picker-endpoints")
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert "subPath" not in mount                    # a subPath mount is never updated
    file = Path(settings["PREFIXD_PICKER_ENDPOINTS_FILE"])
    assert file.parent == Path(mount["mountPath"])
    text = objects[("ConfigMap", "prefixd-picker-endpoints")]["data"][file.name]
    endpoints = from_file(text)
    pool = objects[("InferencePool", "qwen3-pool")]["spec"]
    target_ports = {p["number"] for p in pool["targetPorts"]}
    assert endpoints and all(int(e.address.rsplit(":", 1)[1]) in target_ports for e in endpoints)
    assert pool["selector"]["matchLabels"]


def test_the_route_sends_the_gateways_traffic_to_the_inference_pool():
    objects = _manifests()
    route = objects[("HTTPRoute", "qwen3-route")]["spec"]
    parent = route["parentRefs"][0]
    assert ("Gateway", parent["name"]) in objects and parent["kind"] == "Gateway"
    backend = route["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    assert ("InferencePool", backend["name"]) in objects
    assert objects[("InferencePool", backend["name"])]["apiVersion"] == \
        "inference.networking.k8s.io/v1"
