"""deploy/grafana-dashboard.json queries only what prefixd exports: every metric name in every
PromQL expression (panels and variables) is a sample name of a family in
`prefixd.metrics.REGISTRY` (worker families as federated, with a `backend` label), every label
it groups or filters by belongs to one of those metrics, and counters are only rated."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics import MetricWrapperBase

from prefixd.metrics import REGISTRY
from prefixd.metrics import prefix as prefix_metrics
from prefixd.metrics import proxy as proxy_metrics
from prefixd.metrics import worker as worker_metrics
from prefixd.metrics.federate import PREFIX as WORKER_PREFIX

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana-dashboard.json"
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
            "or", "unless", "offset", "inf", "nan"}
RATED = ("_total", "_sum", "_count", "_bucket")


def exported() -> dict[str, set[str]]:
    """Every sample name prefixd exports -> its label names (`le` for buckets)."""
    labels: dict[str, set[str]] = {}
    for module in (proxy_metrics, prefix_metrics, worker_metrics):
        for m in vars(module).values():
            if isinstance(m, MetricWrapperBase):
                extra = {"backend"} if m._name.startswith(WORKER_PREFIX) else set()
                labels[m._name] = set(m._labelnames) | extra
    names: dict[str, set[str]] = {}
    for family in REGISTRY.collect():   # incl. the process collector's families
        for suffix in SUFFIXES[family.type]:
            names[family.name + suffix] = labels.get(family.name, set()) | (
                {"le"} if suffix == "_bucket" else set())
    return names


def exprs(node: Any) -> Iterator[str]:
    """Every PromQL expression: panel targets' `expr` and query variables' `query`."""
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, str) and (k == "expr" or (k == "query" and "label_values(" in v)):
                yield v
            else:
                yield from exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from exprs(v)


def parse(expr: str) -> tuple[set[str], set[str], list[str]]:
    """(metric names, label names used, metrics inside rate()/increase()) of one expression."""
    used = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*\"", expr))
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)                  # string literals
    rated = re.findall(r"\b(?:rate|irate|increase)\(\s*([A-Za-z_:][\w:]*)", expr)
    m = re.match(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*(\w+)\s*\)\s*$", expr)
    if m:
        return {m.group(1)}, {m.group(2)}, []
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)",
                            expr):
        used |= {x.strip() for x in group.split(",") if x.strip()}
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\w+", " ", expr)       # matchers, ranges, variables
    tokens = re.findall(r"(?<![\w.])([A-Za-z_:][\w:]*)\b(?!\s*\()", expr)
    return {t for t in tokens if t.lower() not in KEYWORDS}, used, rated


def problems(dashboard: dict) -> list[str]:
    names = exported()
    out = []
    for expr in exprs(dashboard):
        metrics, labels, rated = parse(expr)
        if not metrics:
            out.append(f"no metric in {expr!r}")
        out += [f"{n} is not exported by prefixd (in {expr!r})" for n in metrics if n not in names]
        known = set().union(*(names.get(n, set()) for n in metrics))
        out += [f"label {lb!r} belongs to none of {sorted(metrics)} (in {expr!r})"
                for lb in labels - known]
        out += [f"rate() of {n}, which is not a counter (in {expr!r})"
                for n in rated if not n.endswith(RATED)]
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_query_uses_exported_metrics_and_labels(dashboard):
    assert len(list(exprs(dashboard))) >= 30
    assert problems(dashboard) == []


def test_the_check_catches_misspelled_metrics_and_labels(dashboard):
    text = json.dumps(dashboard)
    for good, bad in [("prefixd_queue_wait_seconds_bucket", "prefixd_queue_wait_second_bucket"),
                      ("prefixd_worker_cache_evictions_total", "prefixd_worker_evictions_total"),
                      ("prefixd_prefix_lanes", "prefixd_prefix_lane"),
                      ("by (cause)", "by (cuase)"),
                      ('status=~\\"5..\\"', 'code=~\\"5..\\"')]:
        assert good in text, good
        broken = json.loads(text.replace(good, bad, 1))
        assert any(bad.split(" ")[-1].strip("()").split("=")[0] in p
                   for p in problems(broken)), (good, bad)
    rated_gauge = copy.deepcopy(dashboard)
    rated_gauge["panels"][1]["targets"][0]["expr"] = "rate(prefixd_queue_depth[5m])"
    assert any("not a counter" in p for p in problems(rated_gauge))


def test_dashboard_covers_the_issue_and_imports_with_a_datasource_input(dashboard):
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["schemaVersion"] >= 38
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in panels)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    used = set().union(*(parse(e)[0] for e in exprs(dashboard)))
    for name in ("prefixd_requests_total", "prefixd_queue_wait_seconds_bucket",
                 "prefixd_time_to_first_token_seconds_bucket", "prefixd_prefix_reuse_ratio_sum",
                 "prefixd_prefix_mutations_total", "prefixd_canonicalize_saved_tokens_total",
                 "prefixd_worker_cache_bytes", "prefixd_worker_cached_tokens_total",
                 "prefixd_worker_cache_evictions_total", "prefixd_backend_restarts_total"):
        assert name in used, name
