"""The planner's Prometheus series, on the router's registry (one scrape of the router covers it).

- `pdserve:autoscale_decisions_total{action,pool,reason}`: every decision the loop took (add,
  remove, shift: a hybrid worker's duty, `pool` the duty it takes), holds
  included (`pool` "none"), with the rule's short reason code;
- `pdserve:pool_workers{pool,state}`: workers per pool, `state` serving, draining or spare (warm,
  not serving);
- `pdserve:slo_attainment{slo}`: the window's SLO attainment, `slo` both, ttft or tpot;
- `pdserve:autoscale_arrival_rate`: requests per second over the window;
- `pdserve:autoscale_pool_busy{pool}`, `pdserve:autoscale_pool_load{pool}`: the window's mean
  fraction of the pool's workers busy and requests in flight per worker (what the scale-down
  and the `load_rising` trigger read);
- `pdserve:autoscale_duties{duty}`: serving hybrid workers per duty (prefill, mixed, decode; all 0
  without hybrid workers).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.launcher.autoscale.rule import DUTIES


class AutoscaleMetrics:
    def __init__(self, registry: CollectorRegistry, pools: tuple[str, ...] = ()) -> None:
        self.decisions = Counter(
            "pdserve:autoscale_decisions_total",
            "Autoscaler decisions by action (add, remove, shift, hold), pool and reason code.",
            ["action", "pool", "reason"], registry=registry)
        self.pool_workers = Gauge(
            "pdserve:pool_workers",
            "Workers per pool as the autoscaler sees them, by state (serving, draining, spare).",
            ["pool", "state"], registry=registry)
        self.attainment = Gauge(
            "pdserve:slo_attainment",
            "Fraction of the requests finished in the autoscaler's window that met the SLO (slo: both, ttft, tpot).",
            ["slo"], registry=registry)
        self.arrival_rate = Gauge(
            "pdserve:autoscale_arrival_rate", "Requests per second arriving, over the autoscaler's window.",
            registry=registry)
        self.pool_busy = Gauge(
            "pdserve:autoscale_pool_busy", "Mean fraction of the pool's workers busy over the autoscaler's window.",
            ["pool"], registry=registry)
        self.pool_load = Gauge(
            "pdserve:autoscale_pool_load",
            "Mean requests in flight per worker of the pool over the autoscaler's window.",
            ["pool"], registry=registry)
        self.duties = Gauge(
            "pdserve:autoscale_duties", "Serving hybrid workers per duty (prefill, mixed, decode).",
            ["duty"], registry=registry)
        for pool in pools:  # every series a dashboard queries exists before its first event
            for state in ("serving", "draining", "spare"):
                self.pool_workers.labels(pool, state)
            self.pool_busy.labels(pool)
            self.pool_load.labels(pool)
        for duty in DUTIES:
            self.duties.labels(duty)
        for slo in ("both", "ttft", "tpot"):
            self.attainment.labels(slo).set(1.0)
