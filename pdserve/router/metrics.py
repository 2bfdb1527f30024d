"""Prometheus metrics of the router, one CollectorRegistry per app.

Latencies are observed per backend request (one per choice), request counts per HTTP request.
`placement_decisions`, `kv_transfer_*`, `request_recoveries` and the per-link gauges `link_*`
(label `link` = "src_node->dst_node") and `policy_calibration_factor` (a learning policy's
factors, router.placement.policies.calibration) are declared here and updated by the cluster backend
(router.cluster.backend), which also sets its label sets to 0 at start, so that every series a
dashboard queries (deploy/grafana) exists before its first event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST as METRICS_CONTENT_TYPE

__all__ = ["METRICS_CONTENT_TYPE", "RequestStatus", "RouterMetrics"]

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                       0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               300.0, 600.0)
WORKER_WAIT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


RECOVERY_KINDS = ("replace", "local_fallback", "migrate", "degraded")


class RequestStatus:
    OK = "ok"
    ERROR = "error"  # any error response: 4xx from validation or 5xx from the backend
    ABORTED = "aborted"  # the client went away before the response was complete


@dataclass
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))

    def __post_init__(self) -> None:
        r = self.registry
        self.time_to_first_token = Histogram(
            "pdserve:time_to_first_token_seconds", "Time from request arrival to the first generated token.",
            registry=r, buckets=TTFT_BUCKETS,
        )
        self.time_per_output_token = Histogram(
            "pdserve:time_per_output_token_seconds", "Mean time between generated tokens after the first, per request.",
            registry=r, buckets=TPOT_BUCKETS,
        )
        self.e2e_request_latency = Histogram(
            "pdserve:e2e_request_latency_seconds", "Time from request arrival to the last generated token.",
            registry=r, buckets=E2E_BUCKETS,
        )
        self.requests = Counter(
            "pdserve:requests_total", "Generation requests by endpoint and final status (ok, error, aborted).",
            ["endpoint", "status"], registry=r,
        )
        self.placement_decisions = Counter(
            "pdserve:placement_decisions_total",
            "Placement decisions by policy and kind (e.g. disaggregated, local_prefill).",
            ["policy", "kind"], registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "pdserve:kv_transfer_bytes_total",
            "KV bytes pushed from prefill to decode workers, as reported by Prefill, per link (src_node->dst_node).",
            ["link"], registry=r,
        )
        self.kv_wire_bytes = Counter(
            "pdserve:kv_wire_bytes_total",
            "KV bytes moved between workers, by their precision on the wire (full | fp8).",
            ["precision"], registry=r,
        )
        self.kv_bytes_saved = Counter(
            "pdserve:kv_bytes_saved_total",
            "KV bytes that FP8 on the wire saved against full precision.", registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            "pdserve:kv_transfer_seconds", "Time a prefill worker spent pushing one request's KV, per link.",
            ["link"], registry=r, buckets=KV_TRANSFER_BUCKETS,
        )
        self.kv_transfer_phase_seconds = Histogram(
            "pdserve:kv_transfer_phase_seconds",
            "Where one request's KV transfer time went, by phase (sender: stage, queue, wire, ack; "
            "see kvtransfer.SENDER_PHASES).", ["phase"], registry=r, buckets=KV_TRANSFER_BUCKETS,
        )
        self.first_token_phase_seconds = Histogram(
            "pdserve:first_token_phase_seconds",
            "Where a disaggregated request's time to first token went: reserve (the decode worker's "
            "Reserve call), prefill (the prefill worker's queue and compute up to the first token), "
            "kv_tail (the KV still in flight after it), rpc (the rest of the Prefill call).",
            ["phase"], registry=r, buckets=KV_TRANSFER_BUCKETS,
        )
        self.request_recoveries = Counter(
            "pdserve:request_recoveries_total",
            "Requests recovered by kind: replace (re-placed after a worker failed before its first token), "
            "local_fallback (KV transfer past its deadline: prefill on the decode worker), migrate (moved "
            "mid-stream with its generated tokens), degraded (run whole on a surviving worker of the other role).",
            ["kind"], registry=r,
        )
        for kind in RECOVERY_KINDS:
            self.request_recoveries.labels(kind)
        self.requests_waiting_for_worker = Gauge(
            "pdserve:requests_waiting_for_worker",
            "Requests held by the router because no worker can serve them now (e.g. the only one restarts).",
            registry=r,
        )
        self.worker_wait_seconds = Histogram(
            "pdserve:worker_wait_seconds", "Time a request waited for a worker to come back.",
            registry=r, buckets=WORKER_WAIT_BUCKETS,
        )
        self.worker_wait_timeouts = Counter(
            "pdserve:worker_wait_timeouts_total",
            "Requests that got 503 after waiting the whole --worker-wait-s for a worker.", registry=r,
        )
        self.requests_waiting = Gauge(
            "pdserve:requests_waiting",
            "Requests the router has accepted that have no first token yet: waiting for KV blocks on a "
            "worker (a burst beyond the KV capacity queues), for a worker, or in prefill. Bounded by "
            "--max-queued-requests (past it: 429).", registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "pdserve:queue_wait_seconds",
            "Time from a request's arrival at the router to its first token (or to its end without one), "
            "queueing for KV blocks included.", registry=r, buckets=QUEUE_WAIT_BUCKETS,
        )
        self.requests_rejected = Counter(
            "pdserve:requests_rejected_total",
            "Requests refused by the router's queue bounds: queue_full (429, --max-queued-requests), "
            "queue_timeout (503, no first token within --queue-timeout-s).", ["reason"], registry=r,
        )
        for reason in ("queue_full", "queue_timeout"):
            self.requests_rejected.labels(reason)
        self.link_bytes_in_flight = Gauge(
            "pdserve:link_bytes_in_flight",
            "KV bytes of the transfers the router has started on a link and not seen end.",
            ["link"], registry=r,
        )
        self.link_active_flows = Gauge(
            "pdserve:link_active_flows", "KV transfers in flight on a link.", ["link"], registry=r,
        )
        self.link_estimated_gbps = Gauge(
            "pdserve:link_estimated_gbps",
            "Bandwidth the router assumes for a link: min(capacity, EWMA of measured throughput), Gbit/s.",
            ["link"], registry=r,
        )
        self.policy_calibration_factor = Gauge(
            "pdserve:policy_calibration_factor",
            "Observed / predicted factor the placement policy applies to its model, by quantity (e.g. "
            "prefill, ttft.disaggregated, split.tpot.local); 1 until it has enough outcomes.",
            ["policy", "quantity"], registry=r,
        )
        self.prompt_tokens = Counter("pdserve:prompt_tokens_total", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens_total", "Generated tokens.", registry=r)
        # counted per request when it ends, from the cached-token count its worker's engine
        # reported (the block manager's prefix-cache hit at admission): exact for a run's window,
        # unlike the polled per-worker block counters below
        self.prefix_cache_hit_tokens = Counter(
            "pdserve:prefix_cache_hit_tokens_total",
            "Prompt tokens of prefilled requests that the worker's prefix cache already held.", registry=r)
        self.prefix_cache_query_tokens = Counter(
            "pdserve:prefix_cache_query_tokens_total",
            "Prompt tokens of prefilled requests (looked up in the worker's prefix cache).", registry=r)

    def observe_choice(self, *, arrival: float, first_token: float | None, last_token: float | None,
                       num_output_tokens: int) -> None:
        """Records the latencies of one backend request (times from time.monotonic())."""
        self.generation_tokens.inc(num_output_tokens)
        if first_token is None or last_token is None:
            return
        self.time_to_first_token.observe(first_token - arrival)
        self.e2e_request_latency.observe(last_token - arrival)
        if num_output_tokens > 1:
            self.time_per_output_token.observe((last_token - first_token) / (num_output_tokens - 1))

    def observe_prefix_cache(self, *, prompt_tokens: int, cached_tokens: int) -> None:
        """One prefilled request: `cached_tokens` of its `prompt_tokens` came from the prefix cache."""
        self.prefix_cache_query_tokens.inc(prompt_tokens)
        self.prefix_cache_hit_tokens.inc(min(cached_tokens, prompt_tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# Worker-side figures, read from the stats the router polls (one scrape of the router covers
# the cluster): (name, help, StatsResponse field or callable, type).
_WORKER_SERIES = (
    ("pdserve:worker_up", "1 while the router sees the worker healthy.", None, "gauge"),
    ("pdserve:num_requests_waiting", "Requests waiting to be scheduled on the worker.", "num_waiting", "gauge"),
    ("pdserve:num_requests_running", "Requests in the worker's running batch.", "num_running", "gauge"),
    ("pdserve:kv_cache_usage_ratio", "Fraction of the worker's KV blocks in use.",
     lambda s: 1.0 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0, "gauge"),
    ("pdserve:prefix_cache_hits", "Blocks served from the worker's prefix cache.", "prefix_cache_hits", "counter"),
    ("pdserve:prefix_cache_queries", "Full blocks looked up in the worker's prefix cache.", "prefix_cache_queries",
     "counter"),
    ("pdserve:worker_kv_transfer_bytes", "KV bytes the worker sent or received.", "kv_transfer_bytes", "counter"),
    ("pdserve:worker_kv_transfer_seconds", "Seconds the worker's KV transfers took.", "kv_transfer_seconds",
     "counter"),
    ("pdserve:kv_transfer_gbps", "Achieved KV transfer rate of the worker, Gbit/s (bytes / transfer time).",
     lambda s: s.kv_transfer_bytes * 8 / s.kv_transfer_seconds / 1e9 if s.kv_transfer_seconds else 0.0, "gauge"),
    ("pdserve:num_preemptions", "Requests the worker preempted for lack of KV blocks.", "num_preemptions",
     "counter"),
    ("pdserve:engine_steps", "Engine steps the worker ran.", "engine_steps", "counter"),
    ("pdserve:engine_step_seconds", "Wall time of the worker's engine steps.", "engine_step_seconds", "counter"),
    ("pdserve:engine_decode_only_steps", "Engine steps with decodes only (CUDA graphs on a GPU).",
     "engine_decode_only_steps", "counter"),
    ("pdserve:engine_decode_only_step_seconds", "Wall time of the worker's decode-only engine steps.",
     "engine_decode_only_seconds", "counter"),
    ("pdserve:engine_prefill_graph_steps", "Engine steps with prefill rows that replayed piecewise CUDA graphs.",
     "engine_prefill_graph_steps", "counter"),
    ("pdserve:engine_prefill_graph_step_seconds", "Wall time of the worker's engine steps through the prefill graphs.",
     "engine_prefill_graph_seconds", "counter"),
    ("pdserve:engine_idle_seconds", "Time the worker's engine thread waited with no work.", "engine_idle_seconds",
     "counter"),
    ("pdserve:engine_cpu_seconds", "CPU time of the worker's engine thread in its steps.", "engine_cpu_seconds",
     "counter"),
    ("pdserve:worker_process_cpu_seconds", "CPU time of the worker process, every thread.", "process_cpu_seconds",
     "counter"),
)


class WorkerStatsCollector:
    """A prometheus collector over `workers()`: objects with worker_id, endpoint.role, healthy
    and stats (a StatsResponse or None)."""

    def __init__(self, workers) -> None:
        self.workers = workers

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        workers = list(self.workers())
        for name, help_text, field_name, kind in _WORKER_SERIES:
            family_cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_cls(name.removesuffix("_total"), help_text, labels=["worker", "role"])
            for w in workers:
                labels = [w.worker_id, w.endpoint.role]
                if field_name is None:
                    family.add_metric(labels, 1.0 if w.healthy else 0.0)
                elif w.stats is not None:
                    value = field_name(w.stats) if callable(field_name) else getattr(w.stats, field_name)
                    family.add_metric(labels, float(value))
            yield family

