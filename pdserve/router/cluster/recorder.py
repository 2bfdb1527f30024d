"""What the cluster backend records of each request: its metrics, its timing, its outcome.

`RequestRecorder` is the backend's one writer of the router's metrics (router.metrics): placement
decisions, recoveries, refusals, queue and worker waits, where a disaggregated first token's time
went, and the KV each transfer moved. With no metrics registry it records nothing.

Timing: `RequestOutput.timing` of a finished request is a pdserve.timing.RequestTiming, built as
the request runs (the attempt that produced its first token; `disaggregated_timing` is its
disaggregated part); its JSON keys are `TIMING_KEYS`.

Feedback to the policy: a request that finishes (not aborted, not failed) is reported to
`policy.observe_outcome` as a `pdserve.router.placement.base.Outcome`: where its first token came from
(`RequestOutput.timing`), TTFT from the backend's receipt of the request to its first token,
TPOT over the later tokens, the prefill its prefill worker reported (P's queue excluded); the
policy's current `calibration_factors()` go to the gauge `pdserve:policy_calibration_factor`.
An exception raised there is logged; the request is served regardless.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, get_args

from pdserve.router.cluster.flight import Flight
from pdserve.router.cluster.worker_client import PrefillResult
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement.base import Decision, DecisionKind, Outcome, PlacementPolicy
from pdserve.timing import RequestTiming

logger = logging.getLogger(__name__)

# What `RequestOutput.timing` of a finished request holds: pdserve.timing.RequestTiming, built
# by the backend as the request runs (the attempt that produced its first token); its JSON keys:
TIMING_KEYS = RequestTiming.json_keys()


class RequestRecorder:
    """Records requests into `metrics` (module docstring); every method is a no-op without it."""

    def __init__(self, metrics: RouterMetrics | None) -> None:
        self.metrics = metrics

    def start(self, policy: PlacementPolicy, workers: Callable[[], list[Any]]) -> None:
        """Exports the workers' stats (`workers()`: the pool's workers now) and sets every series of
        the policy's decisions and calibration factors, so that each exists before its first change."""
        if self.metrics is None:
            return
        from pdserve.router.metrics import WorkerStatsCollector

        self.metrics.registry.register(WorkerStatsCollector(workers))
        for kind in get_args(DecisionKind):  # every series exists (at 0) before its first decision
            self.metrics.placement_decisions.labels(policy.name, kind)
        self.set_calibration_gauges(policy)

    # ---------------------------------------------------------------- counts

    def count_decision(self, policy_name: str, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.placement_decisions.labels(policy_name, kind).inc()

    def count_recovery(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.request_recoveries.labels(kind).inc()

    def count_rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests_rejected.labels(reason).inc()

    # ---------------------------------------------------------------- waits

    def set_queued(self, num_queued: int, waited_s: float | None = None) -> None:
        """The requests without a first token now; `waited_s`: the queue wait of one that left."""
        if self.metrics is None:
            return
        self.metrics.requests_waiting.set(num_queued)
        if waited_s is not None:
            self.metrics.queue_wait_seconds.observe(waited_s)

    @contextlib.contextmanager
    def waiting_for_worker(self, start: float) -> Iterator[None]:
        """A request waits for a worker (since time.monotonic() `start`) while the block runs."""
        if self.metrics is not None:
            self.metrics.requests_waiting_for_worker.inc()
        try:
            yield
        finally:
            if self.metrics is not None:
                self.metrics.requests_waiting_for_worker.dec()
                self.metrics.worker_wait_seconds.observe(time.monotonic() - start)

    def count_worker_wait_timeout(self) -> None:
        if self.metrics is not None:
            self.metrics.worker_wait_timeouts.inc()

    # ---------------------------------------------------------------- KV transfers

    def record_first_token_phases(self, reserve_s: float, prefill_rpc_s: float, result: PrefillResult) -> None:
        """Where a disaggregated first token's time went: D's Reserve, P's queue and prefill up
        to the first token, the KV still in flight after it, and the rest of the Prefill RPC."""
        if self.metrics is None:
            return
        kv_tail = max(0.0, result.kv_seconds - result.kv_phases.get("stage", result.kv_seconds))
        phases = {"reserve": reserve_s, "prefill": result.prefill_seconds, "kv_tail": kv_tail,
                  "rpc": max(0.0, prefill_rpc_s - result.prefill_seconds - kv_tail)}
        for phase, seconds in phases.items():
            self.metrics.first_token_phase_seconds.labels(phase=phase).observe(seconds)

    def record_transfer(self, link: str, result: PrefillResult) -> None:
        """The KV a Prefill moved over `link`: bytes, seconds and phases, and its wire precision's bytes."""
        if self.metrics is None or not result.kv_bytes:
            return
        self.metrics.kv_transfer_bytes.labels(link).inc(result.kv_bytes)
        self.metrics.kv_transfer_seconds.labels(link).observe(result.kv_seconds)
        for phase, seconds in (result.kv_phases or {}).items():
            self.metrics.kv_transfer_phase_seconds.labels(phase=phase).observe(seconds)
        self.metrics.kv_wire_bytes.labels(result.kv_precision).inc(result.kv_bytes)
        self.metrics.kv_bytes_saved.inc(result.kv_bytes_saved)

    # ---------------------------------------------------------------- feedback to the policy

    def report_outcome(self, policy: PlacementPolicy, flight: Flight, arrival: float, first_token: float | None,
                       num_tokens: int) -> None:
        """Tells `policy` how a finished request went (module docstring); never raises."""
        try:
            timing = flight.timing or RequestTiming()
            placement = timing.placement
            decode = timing.decode_worker
            if placement not in ("local", "disaggregated") or decode is None:
                return
            now = time.monotonic()
            prefill_s = timing.prefill_s if placement == "disaggregated" else None
            queue_s = timing.queue_s if placement == "disaggregated" else None
            outcome = Outcome(
                request_id=flight.request_id, placement=placement, prefill_worker=timing.prefill_worker,
                decode_worker=decode, prompt_tokens=flight.num_prompt_tokens, output_tokens=num_tokens,
                ttft_s=None if first_token is None else first_token - arrival,
                tpot_s=(now - first_token) / (num_tokens - 1) if first_token is not None and num_tokens > 1 else None,
                prefill_s=prefill_s, prefill_queue_s=queue_s, attempts=flight.num_attempts,
            )
            policy.observe_outcome(outcome)
        except Exception:
            logger.warning("policy %s: observe_outcome failed for request %s; the request is unaffected",
                           policy.name, flight.request_id, exc_info=True)
            return
        self.set_calibration_gauges(policy)

    def set_calibration_gauges(self, policy: PlacementPolicy) -> None:
        if self.metrics is None:
            return
        try:
            factors = policy.calibration_factors()
            for name, value in factors.items():
                self.metrics.policy_calibration_factor.labels(policy.name, name).set(value)
        except Exception:
            logger.warning("policy %s: calibration_factors failed", policy.name, exc_info=True)


def disaggregated_timing(decision: Decision, reserve_s: float, prefill_rpc_s: float,
                         result: PrefillResult) -> dict[str, Any]:
    """The disaggregated part of `RequestOutput.timing` (RequestTiming's fields)."""
    phases = result.kv_phases
    queue = min(result.queue_seconds, result.prefill_seconds)
    return dict(
        placement="disaggregated", prefill_worker=decision.prefill, decode_worker=decision.decode,
        reserve_s=reserve_s, queue_s=queue, prefill_s=result.prefill_seconds - queue,
        kv_s=result.kv_seconds, kv_wire_s=phases.get("wire"), kv_wait_s=phases.get("queue"),
        kv_tail_s=max(0.0, result.kv_seconds - phases.get("stage", result.kv_seconds)),
        prefill_rpc_s=prefill_rpc_s, kv_bytes=result.kv_bytes, kv_done_at_unix_s=time.time(),
        kv_gbps=result.kv_bytes * 8 / result.kv_seconds / 1e9 if result.kv_seconds > 0 else None,
        kv_link_s=phases.get("link"),
        kv_link_bytes=getattr(result, "kv_link_bytes", 0) if "link" in phases else None,
        kv_precision=result.kv_precision, kv_bytes_saved=result.kv_bytes_saved,
        kv_precision_reason=getattr(decision, "kv_precision_reason", "") or None,
    )
