"""The Grafana dashboard asks only for metrics the code exports, with PromQL that fits their types."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from connector.metrics import ConnectorCollector
from connector.scheduler_side import SchedulerSide
from tests.connector.conftest import device_blocks, two_leaves
from tests.prometheus import parse, scrape

DASHBOARD = Path(__file__).parents[2] / "cluster" / "grafana" / "dkv-dashboard.json"
METRIC = re.compile(r"\b(dkv_[a-z0-9_]+)")
# The router service's families, exactly as the interface spec fixes them (another part of the code exports them).
ROUTER_FAMILIES = {
    "dkv_router_requests_total": "counter",
    "dkv_router_request_duration_seconds": "histogram",
    "dkv_router_routes_total": "counter",
    "dkv_router_routed_depth_blocks": "histogram",
    "dkv_router_members": "gauge",
    "dkv_router_index_entries": "gauge",
    "dkv_router_ready": "gauge",
    "dkv_router_resyncs_total": "counter",
}


def _panels() -> list[dict[str, Any]]:
    return json.loads(DASHBOARD.read_text())["panels"]


def _exprs() -> list[str]:
    return [t["expr"] for p in _panels() if p["type"] != "row" for t in p["targets"]]


def sample_names(types: dict[str, str]) -> dict[str, str]:
    """Sample name -> its family's type, for families as the parser names them (counters without ``_total``)."""
    names = {}
    for family, kind in types.items():
        if kind == "counter":
            names[family + "_total"] = kind
        elif kind == "histogram":
            names.update({family + suffix: kind for suffix in ("_bucket", "_sum", "_count")})
        else:
            names[family] = kind
    return names


async def test_every_metric_the_dashboard_uses_is_exported_by_a_node_a_connector_or_the_router(etcd,
                                                                                              node_factory) -> None:
    node = node_factory(*etcd.node_args("dash-a"), "--metrics-listen", "127.0.0.1:0")
    exported = sample_names(scrape(str(node.ready["metrics_address"])).types)
    assert "dkv_node_publish_queue_blocks" in exported  # the cluster's families too
    sched = SchedulerSide(two_leaves(), device_blocks(two_leaves()), namespace="test/dash", node_address="127.0.0.1:1")
    registry = CollectorRegistry()
    registry.register(ConnectorCollector(sched))
    exported |= sample_names(parse(generate_latest(registry).decode()).types)
    exported |= sample_names({name.removesuffix("_total") if kind == "counter" else name: kind
                              for name, kind in ROUTER_FAMILIES.items()})
    used = {name for expr in _exprs() for name in METRIC.findall(expr)}
    unknown = used - set(exported)
    assert not unknown, f"the dashboard asks for metrics nobody exports: {sorted(unknown)}"
    for prefix in ("dkv_node_", "dkv_router_", "dkv_connector_"):
        assert any(name.startswith(prefix) for name in used), prefix


def test_counters_are_rated_and_quantiles_read_buckets_by_le() -> None:
    for expr in _exprs():
        for match in METRIC.finditer(expr):
            name = match.group(1)
            if name.endswith(("_total", "_bucket")):
                assert re.search(r"(rate|increase)\(\s*$", expr[:match.start()]), f"{name} not rated in {expr}"
            if name.endswith("_bucket"):
                assert expr.startswith("histogram_quantile(") and re.search(r"by \(le\b", expr), expr
        assert expr.count("(") == expr.count(")"), expr


def test_the_dashboard_has_a_row_per_component_and_well_formed_panels() -> None:
    panels = _panels()
    assert [p["title"] for p in panels if p["type"] == "row"] == ["Nodes", "Router service", "Connectors"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        grid = p["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
    templating = {v["name"] for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert templating == {"datasource", "instance"}
