"""deploy/grafana's dashboard against a running router's /metrics (fake gRPC workers, 1P+1D):
every metric its PromQL queries is served, with the labels its legends and `by (...)` use,
and the Prometheus scrape config points at that endpoint."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.directory import StaticDirectory
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement.registry import make_policy
from pdserve.router.http.server import create_app
from tests.router.conftest import MODEL, CharTokenizer, ServerThread, wait_until
from tests.router.fake_workers import PREFILL_KV_BYTES_PER_TOKEN, Cluster, FakeWorker
from tests.router.test_cluster_openai import LoopThread

DEPLOY = os.path.join(os.path.dirname(__file__), "..", "..", "deploy")
DASHBOARD = os.path.join(DEPLOY, "grafana", "pdserve-dashboard.json")
METRIC = re.compile(r"\bpdserve:[A-Za-z0-9_:]+")
BY = re.compile(r"\bby\s*\(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")

# what the issue asks the dashboard to show, by panel title
REQUIRED_PANELS = (
    "Time to first token", "Time per output token", "Requests per second", "Tokens per second",
    "Queue depth per worker", "KV cache usage per worker", "KV transfer GB/s per link", "KV transfer seconds per link",
    "Deadline fallbacks, re-placements, migrations", "Preemptions per second", "Placement decisions by policy",
    "Workers per pool", "SLO attainment", "Autoscaler decisions",
)


def panels(node: dict) -> Iterator[dict]:
    for panel in node.get("panels", []):
        yield panel
        yield from panels(panel)


def dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def scraped() -> dict[str, list[dict[str, str]]]:
    """sample name -> the label sets it has, from a router that served two requests."""
    loop = LoopThread()
    shared = Cluster()
    workers = [FakeWorker("p0", "prefill", shared), FakeWorker("d0", "decode", shared)]
    try:
        for worker in workers:
            loop.call(worker.start())
        metrics = RouterMetrics()
        # what `pdserve up --autoscale` adds to the same registry (the dashboard's autoscaling row)
        from pdserve.launcher.autoscale.metrics import AutoscaleMetrics

        AutoscaleMetrics(metrics.registry, ("prefill", "decode")).decisions.labels("add", "decode", "tpot_miss").inc()
        backend = ClusterBackend(
            StaticDirectory([w.endpoint for w in workers]), make_policy("round-robin"), CharTokenizer(), MODEL, 128,
            stats_interval_s=0.05, health_timeout_s=0.5, rpc_timeout_s=2.0, kv_deadline_s=2.0, metrics=metrics,
        )
        with ServerThread(create_app(backend, metrics=metrics)) as server:
            for body in ({"prompt": "abc", "max_tokens": 3}, {"prompt": "hello", "max_tokens": 4, "stream": True}):
                assert httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body},
                                  timeout=10).status_code == 200
            assert wait_until(lambda: "pdserve:num_requests_waiting{" in httpx.get(server.url + "/metrics").text)
            text = httpx.get(server.url + "/metrics", timeout=5).text
            # the prompts are BOS + their characters: 4 and 6 tokens of KV went p0 -> d0
            kv_bytes = metrics.registry.get_sample_value("pdserve:kv_transfer_bytes_total", {"link": "p0->d0"})
            assert kv_bytes == (4 + 6) * PREFILL_KV_BYTES_PER_TOKEN
    finally:
        for worker in workers:
            loop.call(worker.stop())
        loop.stop()
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(dict(sample.labels))
    return out


def test_dashboard_has_the_panels_and_uses_the_datasource_variable():
    dash = dashboard()
    titles = {p["title"] for p in panels(dash) if p["type"] != "row"}
    assert set(REQUIRED_PANELS) <= titles, set(REQUIRED_PANELS) - titles
    for panel in panels(dash):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "job"}


def test_every_queried_metric_and_label_exists_on_the_router(scraped):
    checked = set()
    for panel in panels(dashboard()):
        for target in panel.get("targets", []):
            expr = target["expr"]
            names = METRIC.findall(expr)
            assert names, expr
            for name in names:
                assert name in scraped, f"{panel['title']}: {name} is not on /metrics"
                checked.add(name)
            labels = set(LEGEND.findall(target.get("legendFormat", "")))
            for group in BY.findall(expr):
                labels |= {label.strip() for label in group.split(",") if label.strip()}
            have = set().union(*(labels_ for name in names for labels_ in scraped[name]))
            assert labels <= have, f"{panel['title']}: labels {labels - have} not on {names}"
    assert len(checked) >= 15
    # the per-link KV series carry the link of the transfer that happened
    assert {"link": "p0->d0"} in scraped["pdserve:kv_transfer_bytes_total"]
    assert {"link": "p0->d0"} in scraped["pdserve:kv_transfer_seconds_count"]
    assert {"kind": "local_fallback"} in scraped["pdserve:request_recoveries_total"]  # 0 before any fallback
    assert {"policy": "round-robin", "kind": "disaggregated"} in scraped["pdserve:placement_decisions_total"]


def test_prometheus_scrapes_the_router_metrics_endpoint():
    with open(os.path.join(DEPLOY, "prometheus", "prometheus.yml")) as f:
        config = yaml.safe_load(f)
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "pdserve" and job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["localhost:8000"]
