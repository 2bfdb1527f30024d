"""`ClusterBackend`: the GenerationBackend that runs requests on gRPC workers.

A request goes through:
1. admission: past `max_queued_requests` requests without a first token, Overloaded (429);
2. placement: the policy answers disaggregated (P, D), local (whole request on D) or colocated;
3. the attempt: D.Reserve -> P.Prefill -> D.Decode, or D.Generate (router.cluster.attempts);
4. recovery, at most `max_retries` times: placed again, prefilled on D, or migrated (below);
5. queueing: a request without a first token after `queue_timeout_s` gets 503 (below);
6. the end: a finished request frees itself, any other exit aborts its parts (router.cluster.flight);
7. feedback: a finished request's outcome goes to the policy (router.cluster.recorder).

Before it serves, the backend warms the workers and their KV pairs (router.cluster.warmup).

Recovery:
- a worker fails (UNAVAILABLE, timeout, death) before any token: its parts are aborted, it
  is marked unhealthy, and the request is placed again without it;
- the KV misses its deadline (Prefill or Decode): fall back to Generate on the same D;
- a worker fails after tokens were yielded: migrate, i.e. Generate on another decode-capable
  worker with `resumed_token_ids` = the tokens yielded so far (the client sees one stream);
- a KV push that fails (Prefill answers ABORTED) is the decode worker's failure;
- no decode-capable worker left (the only one restarts): a prefill worker runs the whole
  request (degraded, `Decision.degraded`); a decode worker prefills locally when no prefill
  worker is left;
- prefill and decode workers up but none that may pair (`kv_compat` keys differ: model, dtype,
  block size, wire version): ServiceUnavailable (503) at once, naming what differs;
- nothing left to serve: the request waits for a worker to come back, up to `worker_wait_s`
  (`pdserve:requests_waiting_for_worker`, `pdserve:worker_wait_seconds`), then
  ServiceUnavailable (503, with Retry-After); no room anywhere: Overloaded (429).

Queueing: a burst beyond the workers' KV capacity waits, it is not an error. A decode
worker's Reserve waits in line for blocks (pdserve/worker/servicer.py), a worker's engine
queues what it cannot admit yet; the router bounds the wait. A request counts as queued
(`pdserve:requests_waiting`) from its arrival to its first token: past `max_queued_requests`
queued requests a new one gets Overloaded (429) at once, and one without a first token after
`queue_timeout_s` is aborted on the workers and gets ServiceUnavailable (503); both carry
Retry-After (`pdserve:requests_rejected_total{reason}`, `pdserve:queue_wait_seconds`).

The `WorkerPool` (router.cluster.worker_pool) keeps the view of the workers: it re-reads the directory
and polls Health/Stats each `stats_interval_s`, cancelling the live streams of a worker that
stops answering, so that its requests migrate at once. The network view (router.cluster.network)
counts each Prefill as a KV flow on its link and learns from what it reports; snapshots carry
the topology, the links and the KV bytes per token; optional probes (router.cluster.probes)
measure links between requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from pdserve.sampling_params import RequestOutput, SamplingParams
from pdserve.timing import RequestTiming
from pdserve.router.backend import Tokenizer
from pdserve.router.cluster.attempts import Attempts
from pdserve.router.cluster.directory import WorkerDirectory
from pdserve.router.cluster.flight import Aborter, Flight
from pdserve.router.cluster.recorder import RequestRecorder
from pdserve.router.cluster.warmup import WarmUp
from pdserve.router.errors import (
    InvalidRequest,
    KVTransferDeadline,
    Overloaded,
    ServiceUnavailable,
    WorkerError,
    WorkerFailed,
    WorkerOverloaded,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement.base import (
    MODES,
    ClusterSnapshot,
    NoCompatiblePair,
    Decision,
    NoWorkersAvailable,
    PlacementPolicy,
    RequestInfo,
    SLOUnattainable,
)
from pdserve.router.cluster.network import NetworkOptions, NetworkTracker
from pdserve.router.cluster.worker_pool import WorkerPool

logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.1  # while a request waits for a worker, placement is retried this often
QUEUE_RETRY_AFTER_S = 5  # Retry-After of a request refused by the queue bounds (full, waited too long)

# --kv-wire-precision: the KV's precision on the wire, "auto" (the placement policy's Decision.kv_precision),
# or "full" / "fp8" for every disaggregated request
KV_WIRE_PRECISIONS = ("auto", "full", "fp8")


class ClusterBackend:
    """Serves requests on the workers of `directory`, placed by `policy` (module docstring).

    `kv_deadline_s` is the time the KV has to land on D; `rpc_timeout_s` bounds every other
    unary call (Abort); Reserve and Prefill, which may wait in line (module docstring, queueing), get
    queue_timeout_s more, and D waits queue_timeout_s + kv_deadline_s for the KV; Health and Stats
    get `health_timeout_s`. Starts on first use if `start()` was not awaited.
    """

    def __init__(
        self,
        directory: WorkerDirectory,
        policy: PlacementPolicy,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        *,
        mode: str = "disaggregated",
        kv_deadline_s: float = 10.0,
        stats_interval_s: float = 0.5,
        health_timeout_s: float = 2.0,
        max_retries: int = 2,
        metrics: RouterMetrics | None = None,
        rpc_timeout_s: float = 5.0,
        network: NetworkOptions | None = None,
        worker_wait_s: float = 0.0,
        cluster_token: str | None = None,
        max_queued_requests: int = 1024,
        queue_timeout_s: float = 600.0,
        kv_wire_precision: str = "auto",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(kv_deadline_s, (int, float)) or kv_deadline_s <= 0:
            raise ValueError(f"kv_deadline_s must be > 0, got {kv_deadline_s!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len!r}")
        if not isinstance(worker_wait_s, (int, float)) or worker_wait_s < 0:
            raise ValueError(f"worker_wait_s must be >= 0, got {worker_wait_s!r}")
        if kv_wire_precision not in KV_WIRE_PRECISIONS:
            raise ValueError(f"kv_wire_precision must be one of {', '.join(KV_WIRE_PRECISIONS)}, "
                             f"got {kv_wire_precision!r}")
        self.kv_wire_precision = kv_wire_precision
        self.worker_wait_s = float(worker_wait_s)
        if not isinstance(max_queued_requests, int) or max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be an integer >= 1, got {max_queued_requests!r}")
        if not isinstance(queue_timeout_s, (int, float)) or not 0 < queue_timeout_s < math.inf:
            raise ValueError(f"queue_timeout_s must be > 0, got {queue_timeout_s!r}")
        self.max_queued_requests = max_queued_requests
        self.queue_timeout_s = float(queue_timeout_s)
        self.num_queued = 0  # requests without a first token yet (module docstring, queueing)
        self.pool = WorkerPool(
            directory, interval_s=stats_interval_s, health_timeout_s=health_timeout_s, rpc_timeout_s=rpc_timeout_s,
            cluster_token=cluster_token,
        )
        self.policy = policy
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.mode = mode
        self.kv_deadline_s = float(kv_deadline_s)
        self.max_retries = max_retries
        self.metrics = metrics
        self.recorder = RequestRecorder(metrics)
        self.recorder.start(policy, lambda: list(self.pool.workers.values()))
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.network = NetworkTracker(network or NetworkOptions(), self.pool, policy, metrics,
                                      rpc_timeout_s=self.rpc_timeout_s, max_model_len=max_model_len)
        self.aborter = Aborter(self.pool)
        self.attempts = Attempts(self.pool, self.network, self.recorder, self.aborter, self.precision_of,
                                 kv_deadline_s=self.kv_deadline_s, queue_timeout_s=self.queue_timeout_s,
                                 rpc_timeout_s=self.rpc_timeout_s)
        self.warmup = WarmUp(self.pool, self.aborter, self.wire_precisions, mode=mode,
                             kv_deadline_s=self.kv_deadline_s, rpc_timeout_s=self.rpc_timeout_s)
        self._flights: dict[str, Flight] = {}
        self._started = False
        self._closed = False
        self._draining = False  # shutting down (`drain`): requests still run, none is placed again
        self._start_lock = asyncio.Lock()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Reads the directory and checks every worker once, then keeps doing so in the background."""
        async with self._start_lock:
            if self._started:
                return
            if self._closed:
                raise ServiceUnavailable("The backend is closed.")
            await self.pool.start()
            self._started = True
            self.network.start()

    def drain(self) -> None:
        """Shutting down: live requests may still finish, but one whose worker fails from now on
        ends (ServiceUnavailable) instead of moving to another worker, and the workers are polled
        no more (they are stopping too); `close` ends the rest."""
        self._draining = True
        self.pool.stop_monitoring()

    async def close(self) -> None:
        """Aborts live requests (bounded), stops the monitor and closes every connection."""
        if self._closed:
            return
        self._closed = True
        self.warmup.close()
        await asyncio.gather(*(self.abort(rid) for rid in list(self._flights)), return_exceptions=True)
        await self.network.close()
        await self.pool.close()
        await self.aborter.wait(self.rpc_timeout_s)

    async def refresh(self) -> None:
        """One monitor round now (re-read the directory, poll every worker)."""
        await self.pool.refresh()

    async def warm_up(self, prompt_token_ids: list[int]) -> None:
        """The workers' and their KV pairs' first-use costs, before the router serves
        (router.cluster.warmup): a one-token Generate of `prompt_token_ids` on every healthy
        worker, then `warm_pairs`; joiners are warmed from then on."""
        await self._ensure_started()
        await self.warmup.warm_up(prompt_token_ids)

    async def warm_pairs(self, prompt_token_ids: list[int], joiner: str | None = None) -> int:
        """Moves a first KV block over each prefill -> decode pair (of `joiner` only, when given);
        returns the pairs warmed (router.cluster.warmup)."""
        return await self.warmup.warm_pairs(prompt_token_ids, joiner)

    async def _ensure_started(self) -> None:
        if not self._started:
            await self.start()
        if self._closed:
            raise ServiceUnavailable("The backend is shutting down.")

    # ---------------------------------------------------------------- views

    def snapshot(self) -> ClusterSnapshot:
        net = self.network
        return ClusterSnapshot(self.pool.snapshots(), mode=self.mode, topology=net.topology,  # type: ignore[arg-type]
                               links=net.links.view(), kv_bytes_per_token=net.kv_bytes_per_token,
                               now=time.monotonic())

    async def health(self) -> dict[str, Any]:
        """Healthy when at least one decode-capable worker is healthy (a disaggregated cluster can
        always prefill locally on D); degraded when only prefill workers are (they then run whole
        requests)."""
        await self._ensure_started()
        workers = self.pool.describe()
        serving = any(w["healthy"] and w["role"] in ("decode", "mixed") for w in workers.values())
        degraded = (not serving and self.mode == "disaggregated"
                    and any(w["healthy"] and w["role"] == "prefill" for w in workers.values()))
        info: dict[str, Any] = {"healthy": serving or degraded, "mode": self.mode, "policy": self.policy.name,
                                "workers": workers}
        if degraded:
            info["degraded"] = "no healthy decode-capable worker: prefill workers run whole requests"
        elif not serving:
            info["reason"] = f"no healthy decode-capable worker among {len(workers)}"
        return info

    # ---------------------------------------------------------------- requests

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        await self._ensure_started()
        if request_id in self._flights:
            raise ValueError(f"request id {request_id!r} is already live")
        if self.num_queued >= self.max_queued_requests:
            self.recorder.count_rejected("queue_full")
            raise Overloaded(f"The server is busy: {self.num_queued} requests are queued (the limit is "
                             f"{self.max_queued_requests}); retry later.",
                             headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)})
        flight = Flight(request_id, len(prompt_token_ids))
        self._flights[request_id] = flight
        arrival = time.monotonic()
        first_token: float | None = None
        num_tokens = 0
        queued = self._enter_queue()
        serve = self._serve(flight, list(prompt_token_ids), params)
        try:
            async with contextlib.aclosing(serve):
                while True:
                    try:
                        if queued:  # the wait for a first token is bounded; a cancelled step aborts its parts
                            left = arrival + self.queue_timeout_s - time.monotonic()
                            output = await asyncio.wait_for(anext(serve), max(0.0, left))
                        else:
                            output = await anext(serve)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        self.recorder.count_rejected("queue_timeout")
                        raise ServiceUnavailable(
                            f"The server is busy: the request waited {self.queue_timeout_s:g}s without being "
                            "served; retry later.", headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)}) from None
                    if queued and (output.new_token_ids or output.finished):
                        queued = self._leave_queue(arrival)
                    if output.new_token_ids:
                        now = time.monotonic()
                        if first_token is None:
                            first_token = now
                            flight.time(first_token_s=now - arrival)
                        num_tokens += len(output.new_token_ids)
                    if output.new_text and (flight.timing is None or flight.timing.first_text_s is None):
                        flight.time(first_text_s=time.monotonic() - arrival)
                    if flight.placed_at is not None:
                        flight.time(place_s=flight.placed_at - arrival)
                        flight.placed_at = None
                    if output.finished and flight.timing is not None:
                        output.timing = replace(flight.timing, attempts=flight.num_attempts)
                    if output.finished and output.finish_reason != "abort" and not flight.aborted:
                        self.recorder.report_outcome(self.policy, flight, arrival, first_token, num_tokens)
                    yield output
        finally:
            if queued:
                self._leave_queue(arrival)
            if self._flights.get(request_id) is flight:
                del self._flights[request_id]

    def _enter_queue(self) -> bool:
        self.num_queued += 1
        self.recorder.set_queued(self.num_queued)
        return True

    def _leave_queue(self, arrival: float) -> bool:
        self.num_queued -= 1
        self.recorder.set_queued(self.num_queued, waited_s=time.monotonic() - arrival)
        return False

    async def abort(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is None or flight.aborted:
            return
        flight.aborted = True
        parts = list(flight.parts.values())
        for client, wire_id in parts:
            client.cancel_calls("the request was aborted", wire_id)
        await self.aborter.abort_parts(parts)

    async def _serve(self, flight: Flight, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        excluded: set[str] = set()
        retries_left = self.max_retries
        fallback_on: str | None = None  # the D whose KV missed its deadline: run there locally
        last_error: WorkerError | None = None
        while True:
            if flight.aborted:
                yield flight.aborted_output()
                return
            if fallback_on is not None and fallback_on in self.pool.workers:
                decision, fallback_on = Decision("local", None, fallback_on, "kv deadline fallback"), None
            else:
                fallback_on = None
                decision = await self._place_or_wait(flight, prompt, params, excluded, last_error)
                if decision is None:  # aborted while waiting
                    yield flight.aborted_output()
                    return
            if not flight.sent_token_ids:
                flight.timing, flight.placed_at = RequestTiming(), time.monotonic()
            if decision.kind == "disaggregated" and not flight.sent_token_ids:
                attempt = self.attempts.disaggregated(flight, decision, prompt, params)
            else:
                attempt = self.attempts.local(flight, decision.decode, prompt, params)
            try:
                async with contextlib.aclosing(attempt):
                    async for output in attempt:
                        output.request_id = flight.request_id
                        flight.sent_token_ids.extend(output.new_token_ids)
                        yield output
                        if output.finished:
                            return
                raise WorkerFailed(f"the stream of worker {decision.decode} ended before the request finished",
                                   worker_id=decision.decode)
            except WorkerError as exc:
                if flight.aborted:
                    yield flight.aborted_output()
                    return
                if self._closed or self._draining:
                    raise ServiceUnavailable("The backend is shutting down.") from exc
                if isinstance(exc, KVTransferDeadline) and decision.kind == "disaggregated":
                    logger.warning("request %s: %s; prefilling on %s instead",
                                   flight.request_id, exc.message, decision.decode)
                    self.recorder.count_recovery("local_fallback")
                    fallback_on = decision.decode
                    continue
                if not isinstance(exc, (WorkerFailed, WorkerOverloaded, KVTransferDeadline)):
                    raise  # the worker rejected the request: the client's error
                last_error = exc
                worker = self.pool.workers.get(exc.worker_id)
                if isinstance(exc, WorkerFailed) and worker is not None:
                    self.pool.mark_down(worker, exc.message, cancel_streams=False)
                excluded.add(exc.worker_id)
                if retries_left == 0:
                    logger.warning("request %s failed after %d retries: %s",
                                   flight.request_id, self.max_retries, exc.message)
                    if isinstance(exc, Overloaded):
                        raise
                    raise self._retry_later(ServiceUnavailable(
                        f"The request failed on every worker tried; last error: {exc.message}")) from exc
                retries_left -= 1
                kind = "migrate" if flight.sent_token_ids else "replace"
                logger.warning("request %s: %s; %s (%d retries left)",
                               flight.request_id, exc.message, kind, retries_left)
                self.recorder.count_recovery(kind)

    def _place(
        self, flight: Flight, prompt: list[int], params: SamplingParams, excluded: set[str],
        last_error: WorkerError | None,
    ) -> Decision:
        request = RequestInfo(
            request_id=flight.request_id,
            num_prompt_tokens=len(prompt),
            max_tokens=params.max_tokens,
            prompt_token_ids=tuple(prompt),
            num_resumed_tokens=len(flight.sent_token_ids),
            excluded=frozenset(excluded),
        )
        snapshot = self.snapshot()
        try:
            decision = self.policy.place(request, snapshot)
        except SLOUnattainable as exc:
            raise Overloaded(f"The cluster cannot serve the request within its SLOs now; retry later ({exc})") from exc
        except NoCompatiblePair as exc:  # a misconfigured cluster: waiting would not help
            raise ServiceUnavailable(f"No worker pair can serve the request: {exc}") from exc
        except NoWorkersAvailable as exc:
            self._check_ever_fits(request, snapshot)
            if isinstance(last_error, Overloaded):
                raise last_error from exc  # every worker left is full: the client may retry later
            cause = f"; last error: {last_error.message}" if last_error is not None else ""
            raise ServiceUnavailable(f"No worker can serve the request: {exc}{cause}") from exc
        self.recorder.count_decision(self.policy.name, decision.kind)
        if decision.degraded:
            self.recorder.count_recovery("degraded")
        logger.debug("request %s -> %s", flight.request_id, decision)
        return decision

    @staticmethod
    def _check_ever_fits(request: RequestInfo, snapshot: ClusterSnapshot) -> None:
        """InvalidRequest (400) when healthy workers can decode but none could ever hold the
        request (its context length or its KV cache is too small): waiting would not help."""
        workers = [w for w in snapshot.workers if w.healthy and w.can_decode]
        if not workers or any(w.fits(request.num_tokens) for w in workers):
            return
        limit = max(min(w.max_model_len or math.inf, (w.num_blocks * w.block_size) or math.inf) for w in workers)
        raise InvalidRequest(
            f"This model's maximum context length is {limit:g} tokens (the largest KV cache among the workers); "
            f"the request needs {request.num_tokens} ({request.num_prompt_tokens} in the prompt, "
            f"{request.max_tokens} max_tokens).", param="max_tokens", code="context_length_exceeded")

    async def _place_or_wait(
        self, flight: Flight, prompt: list[int], params: SamplingParams, excluded: set[str],
        last_error: WorkerError | None,
    ) -> Decision | None:
        """A decision, waiting up to worker_wait_s for a worker when none can serve now; None when
        the request is aborted meanwhile. Past the wait: ServiceUnavailable with Retry-After."""
        try:
            return self._place(flight, prompt, params, excluded, last_error)
        except ServiceUnavailable as exc:
            if self.worker_wait_s <= 0 or self._closed or isinstance(exc.__cause__, NoCompatiblePair):
                raise self._retry_later(exc) from exc
            first_error = exc
        # The workers this request excluded are down (marked so) or may come back restarted.
        excluded.clear()
        start = time.monotonic()
        deadline = start + self.worker_wait_s
        logger.warning("request %s: %s; waiting up to %.0fs for a worker", flight.request_id,
                       first_error.message, self.worker_wait_s)
        with self.recorder.waiting_for_worker(start):
            while True:
                await asyncio.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))
                if flight.aborted:
                    return None
                if self._closed:
                    raise ServiceUnavailable("The backend is shutting down.")
                try:
                    decision = self._place(flight, prompt, params, excluded, last_error)
                except ServiceUnavailable as exc:
                    if time.monotonic() >= deadline:
                        self.recorder.count_worker_wait_timeout()
                        raise self._retry_later(exc, waited_s=time.monotonic() - start) from exc
                    continue
                logger.info("request %s: %s after waiting %.1fs", flight.request_id, decision, time.monotonic() - start)
                return decision

    def _retry_later(self, exc: ServiceUnavailable, waited_s: float | None = None) -> ServiceUnavailable:
        waited = f" (waited {waited_s:.1f}s for a worker)" if waited_s is not None else ""
        retry_after = max(1, math.ceil(self.worker_wait_s))
        return ServiceUnavailable(exc.message + waited, headers={"Retry-After": str(retry_after)})

    # ---------------------------------------------------------------- wire precision

    def precision_of(self, decision: Decision) -> str:
        """The KV's precision on the wire for a disaggregated `decision`: the policy's choice
        (`Decision.kv_precision`) under --kv-wire-precision auto, else the switch's."""
        if self.kv_wire_precision != "auto":
            return self.kv_wire_precision
        return getattr(decision, "kv_precision", "full")  # a policy's own decision type may lack it

    def wire_precisions(self) -> list[str]:
        """Every precision a disaggregated request's KV may go in now (what the warm-up covers)."""
        if self.kv_wire_precision != "auto":
            return [self.kv_wire_precision]
        return ["full", "fp8"] if self.policy.name == "network-aware" else ["full"]
