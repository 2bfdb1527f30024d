"""`ClusterBackend`: the GenerationBackend that runs requests on gRPC workers.

A request goes through:
1. placement: the policy sees a snapshot (worker stats + the router's own in-flight counts)
   and answers disaggregated (P, D), local (whole request on D) or colocated;
2. disaggregated: D.Reserve -> P.Prefill (P pushes KV to D, returns the first token, which is
   yielded at once) -> D.Decode streams the rest. A first token that already finishes the
   request frees D's reservation with D.Abort instead. Local/colocated: D.Generate;
3. recovery, at most `max_retries` times per request:
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
     ServiceUnavailable (503, with Retry-After); no room anywhere: Overloaded (429);
4. queueing: a burst beyond the workers' KV capacity waits, it is not an error. A decode
   worker's Reserve waits in line for blocks (pdserve/worker/server.py), a worker's engine
   queues what it cannot admit yet; the router bounds the wait. A request counts as queued
   (`pdserve:requests_waiting`) from its arrival to its first token: past `max_queued_requests`
   queued requests a new one gets Overloaded (429) at once, and one without a first token after
   `queue_timeout_s` is aborted on the workers and gets ServiceUnavailable (503); both carry
   Retry-After (`pdserve:requests_rejected_total{reason}`, `pdserve:queue_wait_seconds`);
5. the end: a finished request frees itself on the workers; any other exit (error, client
   abort, cancellation) sends Abort to every worker that holds a part of it, bounded in time.

The `WorkerPool` (router.cluster.worker_pool) keeps the view of the workers: it re-reads the directory
and polls Health/Stats each `stats_interval_s`, cancelling the live streams of a worker that
stops answering, so that its requests migrate at once.
Worker-side request ids are "<request_id>" for the first attempt and "<request_id>.<n>" after.

Network view (router.cluster.network): each Prefill is a KV flow on the link from P's node to D's
node (router.placement.topology); the `LinkMonitor` (router.placement.congestion) counts it while it runs and takes
the throughput it reports as a sample (a Prefill whose KV missed its deadline: an upper bound, its
bytes over the deadline, which lowers the link's estimate at once); KV bytes per token are learned
from those reports.
Snapshots carry the topology, the links and that number; optional probes (router.cluster.probes)
measure links between requests.

Feedback to the policy: a request that finishes (not aborted, not failed) is reported to
`policy.observe_outcome` as a `pdserve.router.placement.base.Outcome`: where its first token came from
(`RequestOutput.timing`), TTFT from the backend's receipt of the request to its first token,
TPOT over the later tokens, the prefill its prefill worker reported (P's queue excluded); the
policy's current `calibration_factors()` go to the gauge `pdserve:policy_calibration_factor`.
An exception raised there is logged; the request is served regardless.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, get_args

from pdserve.sampling_params import RequestOutput, SamplingParams
from pdserve.timing import RequestTiming
from pdserve.router.backend import Tokenizer
from pdserve.router.cluster.directory import WorkerDirectory
from pdserve.router.errors import (
    InvalidRequest,
    KVPushFailed,
    KVTransferCorrupted,
    KVTransferDeadline,
    Overloaded,
    ServiceUnavailable,
    WorkerError,
    WorkerFailed,
    WorkerOverloaded,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement.base import (
    DecisionKind,
    MODES,
    ClusterSnapshot,
    NoCompatiblePair,
    Decision,
    NoWorkersAvailable,
    Outcome,
    PlacementPolicy,
    RequestInfo,
    SLOUnattainable,
    kv_keys_pair,
)
from pdserve.router.cluster.network import NetworkOptions, NetworkTracker
from pdserve.router.cluster.worker_client import PrefillResult, WorkerClient
from pdserve.router.cluster.worker_pool import WorkerPool

logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.1  # while a request waits for a worker, placement is retried this often
QUEUE_RETRY_AFTER_S = 5  # Retry-After of a request refused by the queue bounds (full, waited too long)

# What `RequestOutput.timing` of a finished request holds: pdserve.timing.RequestTiming, built
# here as the request runs (the attempt that produced its first token); its JSON keys:
TIMING_KEYS = RequestTiming.json_keys()


# --kv-wire-precision: the KV's precision on the wire, "auto" (the placement policy's Decision.kv_precision),
# or "full" / "fp8" for every disaggregated request
KV_WIRE_PRECISIONS = ("auto", "full", "fp8")
WARM_PAIRS_MAX = 64  # KV pairs a warm-up covers (at start: the first ones; later: a joiner's)
WARM_PAIRS_CONCURRENCY = 8
WARM_PASSES = 2  # per pair and wire precision: the link's first transfer goes staged, the next pulled
WARM_JOINER_TIMEOUT_S = 10.0  # a new worker is placed after this even if a pair is still warming


def _kv_compat(worker) -> str:
    return worker.stats.kv_compat if worker.stats else ""


# (client, worker-side request id) of one worker's part in a request
_Part = tuple[WorkerClient, str]


@dataclass
class _Flight:
    """A live request: what it holds where, and what the client has already received."""

    request_id: str
    num_prompt_tokens: int
    aborted: bool = False
    num_attempts: int = 0
    parts: dict[str, _Part] = field(default_factory=dict)  # worker id -> part
    sent_token_ids: list[int] = field(default_factory=list)
    timing: RequestTiming | None = None  # of the attempt that produced the first token
    placed_at: float | None = None  # time.monotonic() when the current attempt was placed

    def time(self, **measured: Any) -> None:
        """Adds `measured` (RequestTiming fields) to the request's timing."""
        self.timing = replace(self.timing or RequestTiming(), **measured)

    def next_wire_id(self) -> str:
        n = self.num_attempts
        self.num_attempts += 1
        return self.request_id if n == 0 else f"{self.request_id}.{n}"


class ClusterBackend:
    """Serves requests on the workers of `directory`, placed by `policy` (module docstring).

    `kv_deadline_s` is the time the KV has to land on D; `rpc_timeout_s` bounds every other
    unary call (Abort); Reserve and Prefill, which may wait in line (module docstring, 4), get
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
        self.num_queued = 0  # requests without a first token yet (module docstring, 4)
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
        if metrics is not None:
            from pdserve.router.metrics import WorkerStatsCollector

            metrics.registry.register(WorkerStatsCollector(lambda: list(self.pool.workers.values())))
            for kind in get_args(DecisionKind):  # every series exists (at 0) before its first decision
                metrics.placement_decisions.labels(policy.name, kind)
            self._set_calibration_gauges()
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.network = NetworkTracker(network or NetworkOptions(), self.pool, policy, metrics,
                                      rpc_timeout_s=self.rpc_timeout_s, max_model_len=max_model_len)
        self._flights: dict[str, _Flight] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._started = False
        self._closed = False
        self._warm_prompt: list[int] = []
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

    async def close(self) -> None:
        """Aborts live requests (bounded), stops the monitor and closes every connection."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(self.abort(rid) for rid in list(self._flights)), return_exceptions=True)
        await self.network.close()
        await self.pool.close()
        if self._background:
            await asyncio.wait(self._background, timeout=self.rpc_timeout_s)

    async def refresh(self) -> None:
        """One monitor round now (re-read the directory, poll every worker)."""
        await self.pool.refresh()

    async def warm_up(self, prompt_token_ids: list[int]) -> None:
        """Sends every healthy worker a one-token Generate of `prompt_token_ids` (short: it must not
        fill a KV block the prefix cache would keep), outside the metrics and the placement's
        counters: the first real request finds this router's gRPC stream path and the worker's
        (its Generate handler, the engine thread's first step) warm. A worker that fails is logged."""
        await self._ensure_started()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        async def one(worker) -> None:
            try:
                async for _ in worker.client.generate(f"__warmup-router-{worker.worker_id}", prompt_token_ids, params, []):
                    pass
            except Exception as exc:
                logger.warning("warm-up Generate on worker %s failed: %s", worker.worker_id, exc)

        await asyncio.gather(*(one(w) for w in list(self.pool.workers.values()) if w.healthy))
        # joiners are warmed from now on, also if the caller's time runs out in the pairs below
        self._warm_prompt = list(prompt_token_ids)
        self.pool.on_healthy = self._warm_joiner
        await self.warm_pairs(prompt_token_ids)

    async def warm_pairs(self, prompt_token_ids: list[int], joiner: str | None = None) -> int:
        """Moves a first KV block over each prefill -> decode pair (of `joiner` only, when given;
        at most WARM_PAIRS_MAX) before placement uses it: a two-token request, Reserve on D,
        Prefill on P with its KV pushed to D, Decode on D, WARM_PASSES times per wire precision
        the router may use. A pair's first transfer opens its connection, maps the peer's pools
        and compiles the copy kernels: on one H200 the first two PD requests took 0.52 and
        0.34 s to their first token, the next 22-30 ms. Outside the metrics and the placement's
        counters; a pair that fails is logged and skipped. Returns the pairs warmed."""
        pairs = self._pairs_to_warm(joiner)
        if not pairs:
            return 0
        precisions = ([self.kv_wire_precision] if self.kv_wire_precision != "auto"
                      else ["full", "fp8"] if self.policy.name == "network-aware" else ["full"])
        limit = asyncio.Semaphore(WARM_PAIRS_CONCURRENCY)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

        async def pair(prefill, decode) -> bool:
            async with limit:
                for precision in precisions:
                    for n in range(WARM_PASSES):
                        wire_id = f"__warmup-kv-{prefill.worker_id}-{decode.worker_id}-{precision}-{n}"
                        if not await self._warm_once(prefill, decode, wire_id, prompt_token_ids, params, precision):
                            return False
                return True

        done = await asyncio.gather(*(pair(p, d) for p, d in pairs))
        logger.info("KV pairs warmed: %d of %d%s", sum(done), len(pairs), f" (joiner {joiner})" if joiner else "")
        return sum(done)

    def _pairs_to_warm(self, joiner: str | None) -> list[tuple[Any, Any]]:
        if self.mode == "colocated":
            return []
        workers = [w for w in self.pool.workers.values()
                   if w.healthy and not w.draining and (not w.warming or w.worker_id == joiner)]

        pairs = [(p, d) for p in workers if p.endpoint.role in ("prefill", "mixed")
                 for d in workers if d.endpoint.role in ("decode", "mixed")
                 and p is not d and kv_keys_pair(_kv_compat(p), _kv_compat(d))
                 and joiner in (None, p.worker_id, d.worker_id)]
        return pairs[:WARM_PAIRS_MAX]

    async def _warm_once(self, prefill, decode, wire_id: str, prompt: list[int], params: SamplingParams,
                         precision: str) -> bool:
        parts = [(decode.client, wire_id)]
        finished = False
        try:
            reservation = await decode.client.reserve(wire_id, prompt, params, self.kv_deadline_s + self.rpc_timeout_s,
                                                      timeout_s=self.kv_deadline_s + self.rpc_timeout_s)
            parts.append((prefill.client, wire_id))
            result = await prefill.client.prefill(wire_id, prompt, params, reservation, self.kv_deadline_s,
                                                  timeout_s=self.kv_deadline_s + self.rpc_timeout_s,
                                                  kv_precision=precision)
            parts.remove((prefill.client, wire_id))
            if not result.first.finished:
                async for output in decode.client.decode(wire_id, result.first):
                    if output.finished:
                        break
                finished = True
        except Exception as exc:
            logger.info("warm-up of KV pair %s -> %s (%s) failed: %s", prefill.worker_id, decode.worker_id,
                        precision, exc)
        finally:
            if not finished:
                await self._abort_parts(parts)
        return finished

    def _warm_joiner(self, worker, joined: bool) -> None:
        """WorkerPool.on_healthy: a worker that joined (or moved to a new address) is left out of
        placement until its KV pairs are warmed (at most WARM_JOINER_TIMEOUT_S); one back after a
        failed check (a restart at the same address looks the same) is warmed while it serves."""
        if self._closed or not self._pairs_to_warm(worker.worker_id):
            return
        worker.warming = joined

        async def warm() -> None:
            try:
                await asyncio.wait_for(self.warm_pairs(self._warm_prompt, joiner=worker.worker_id),
                                       WARM_JOINER_TIMEOUT_S)
            except Exception as exc:
                logger.warning("warm-up of worker %s's KV pairs: %s", worker.worker_id, exc or type(exc).__name__)
            finally:
                worker.warming = False

        self._spawn(warm())

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
            self._count_rejected("queue_full")
            raise Overloaded(f"The server is busy: {self.num_queued} requests are queued (the limit is "
                             f"{self.max_queued_requests}); retry later.",
                             headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)})
        flight = _Flight(request_id, len(prompt_token_ids))
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
                        self._count_rejected("queue_timeout")
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
                        self._report_outcome(flight, arrival, first_token, num_tokens)
                    yield output
        finally:
            if queued:
                self._leave_queue(arrival)
            if self._flights.get(request_id) is flight:
                del self._flights[request_id]

    def _enter_queue(self) -> bool:
        self.num_queued += 1
        if self.metrics is not None:
            self.metrics.requests_waiting.set(self.num_queued)
        return True

    def _leave_queue(self, arrival: float) -> bool:
        self.num_queued -= 1
        if self.metrics is not None:
            self.metrics.requests_waiting.set(self.num_queued)
            self.metrics.queue_wait_seconds.observe(time.monotonic() - arrival)
        return False

    def _count_rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests_rejected.labels(reason).inc()

    async def abort(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is None or flight.aborted:
            return
        flight.aborted = True
        parts = list(flight.parts.values())
        for client, wire_id in parts:
            client.cancel_calls("the request was aborted", wire_id)
        await self._abort_parts(parts)

    async def _serve(self, flight: _Flight, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        excluded: set[str] = set()
        retries_left = self.max_retries
        fallback_on: str | None = None  # the D whose KV missed its deadline: run there locally
        last_error: WorkerError | None = None
        while True:
            if flight.aborted:
                yield self._aborted_output(flight)
                return
            if fallback_on is not None and fallback_on in self.pool.workers:
                decision, fallback_on = Decision("local", None, fallback_on, "kv deadline fallback"), None
            else:
                fallback_on = None
                decision = await self._place_or_wait(flight, prompt, params, excluded, last_error)
                if decision is None:  # aborted while waiting
                    yield self._aborted_output(flight)
                    return
            if not flight.sent_token_ids:
                flight.timing, flight.placed_at = RequestTiming(), time.monotonic()
            if decision.kind == "disaggregated" and not flight.sent_token_ids:
                attempt = self._run_disaggregated(flight, decision, prompt, params)
            else:
                attempt = self._run_local(flight, decision.decode, prompt, params)
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
                    yield self._aborted_output(flight)
                    return
                if self._closed:
                    raise ServiceUnavailable("The backend is shutting down.") from exc
                if isinstance(exc, KVTransferDeadline) and decision.kind == "disaggregated":
                    logger.warning("request %s: %s; prefilling on %s instead",
                                   flight.request_id, exc.message, decision.decode)
                    self._count_recovery("local_fallback")
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
                self._count_recovery(kind)

    def _place(
        self, flight: _Flight, prompt: list[int], params: SamplingParams, excluded: set[str],
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
        if self.metrics is not None:
            self.metrics.placement_decisions.labels(self.policy.name, decision.kind).inc()
        if decision.degraded:
            self._count_recovery("degraded")
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
        self, flight: _Flight, prompt: list[int], params: SamplingParams, excluded: set[str],
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
        if self.metrics is not None:
            self.metrics.requests_waiting_for_worker.inc()
        try:
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
                        if self.metrics is not None:
                            self.metrics.worker_wait_timeouts.inc()
                        raise self._retry_later(exc, waited_s=time.monotonic() - start) from exc
                    continue
                logger.info("request %s: %s after waiting %.1fs", flight.request_id, decision, time.monotonic() - start)
                return decision
        finally:
            if self.metrics is not None:
                self.metrics.requests_waiting_for_worker.dec()
                self.metrics.worker_wait_seconds.observe(time.monotonic() - start)

    def _retry_later(self, exc: ServiceUnavailable, waited_s: float | None = None) -> ServiceUnavailable:
        waited = f" (waited {waited_s:.1f}s for a worker)" if waited_s is not None else ""
        retry_after = max(1, math.ceil(self.worker_wait_s))
        return ServiceUnavailable(exc.message + waited, headers={"Retry-After": str(retry_after)})

    async def _run_disaggregated(
        self, flight: _Flight, decision: Decision, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        assert decision.prefill is not None
        prefill, decode = self.pool.workers[decision.prefill], self.pool.workers[decision.decode]
        wire_id = flight.next_wire_id()
        finished = False
        flight.parts = {decode.worker_id: (decode.client, wire_id)}
        n = len(prompt)
        # P's queue and the P->D flow count from the decision on, like D's: counted only
        # after D's Reserve answered, requests placed meanwhile saw an idle P and link.
        decode.num_inflight += 1
        decode.num_inflight_tokens += n
        prefill.num_inflight += 1
        prefill.num_inflight_tokens += n
        flow = self.network.start_flow(prefill, decode, n)
        try:
            result: PrefillResult | None = None
            missed_deadline_s: float | None = None  # the KV missed it: the link is slower than it was priced
            try:
                started = time.monotonic()
                # D's Reserve waits in line for blocks and P's Prefill in P's queue: the queue
                # bound (generate) limits both, so D also waits that long for the KV
                queue_s = self.queue_timeout_s
                reservation = await decode.client.reserve(wire_id, prompt, params, queue_s + self.kv_deadline_s,
                                                          timeout_s=queue_s + self.rpc_timeout_s)
                reserved = time.monotonic()
                flight.parts[prefill.worker_id] = (prefill.client, wire_id)
                try:
                    result = await prefill.client.prefill(
                        wire_id, prompt, params, reservation, self.kv_deadline_s,
                        timeout_s=queue_s + self.kv_deadline_s + self.rpc_timeout_s, kv_precision=self.precision_of(decision),
                    )
                except KVPushFailed as exc:  # D did not take the KV: D failed, not P
                    raise WorkerFailed(f"{exc.message} (reported by {prefill.worker_id})",
                                       worker_id=decode.worker_id) from exc
                except KVTransferDeadline as exc:
                    if not isinstance(exc, KVTransferCorrupted):  # late, not damaged
                        missed_deadline_s = self.kv_deadline_s
                    raise
                self._record_first_token_phases(reserved - started, time.monotonic() - reserved, result)
                flight.time(**self._timing(decision, reserved - started, time.monotonic() - reserved, result))
            finally:
                prefill.num_inflight -= 1
                prefill.num_inflight_tokens -= n
                self.network.finish_flow(flow, result, n, missed_deadline_s)
            self._record_transfer(flow.key, result.kv_bytes, result.kv_seconds, result.kv_phases)
            if self.metrics is not None and result.kv_bytes:
                self.metrics.kv_wire_bytes.labels(result.kv_precision).inc(result.kv_bytes)
                self.metrics.kv_bytes_saved.inc(result.kv_bytes_saved)
            first = result.first
            if self._worker_aborted(flight, first):
                raise WorkerFailed(f"worker {prefill.worker_id} aborted the request", worker_id=prefill.worker_id)
            if first.finished:
                finished = True
                self._spawn(self._abort_parts([(decode.client, wire_id)]))  # frees D's reservation
                yield first
                return
            yield first
            decode_started = time.monotonic()
            async for output in decode.client.decode(wire_id, first):
                if flight.timing.first_decode_s is None and output.new_token_ids:
                    flight.time(first_decode_s=time.monotonic() - decode_started)
                if self._worker_aborted(flight, output):
                    if output.new_token_ids:  # keep what it produced; the retry resumes after it
                        yield replace(output, finished=False, finish_reason=None)
                    raise WorkerFailed(f"worker {decode.worker_id} aborted the request", worker_id=decode.worker_id)
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            decode.num_inflight -= 1
            decode.num_inflight_tokens -= n
            parts, flight.parts = list(flight.parts.values()), {}
            if not finished and not flight.aborted:
                await self._abort_parts(parts)

    async def _run_local(
        self, flight: _Flight, worker_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        worker = self.pool.workers[worker_id]
        wire_id = flight.next_wire_id()
        finished = False
        flight.parts = {worker_id: (worker.client, wire_id)}
        n = len(prompt) + len(flight.sent_token_ids)
        if not flight.sent_token_ids:
            flight.time(placement="local", decode_worker=worker_id)
        worker.num_inflight += 1
        worker.num_inflight_tokens += n
        try:
            async for output in worker.client.generate(wire_id, prompt, params, flight.sent_token_ids):
                if output.worker_timing is not None:  # the worker's part of the first token
                    if flight.timing.first_token_s is None and output.new_token_ids:
                        w = output.worker_timing
                        flight.time(queue_s=w.queue_s, prefill_s=w.prefill_s, worker_handoff_s=w.handoff_s)
                    output.worker_timing = None
                if self._worker_aborted(flight, output):
                    if output.new_token_ids:
                        yield replace(output, finished=False, finish_reason=None)
                    raise WorkerFailed(f"worker {worker_id} aborted the request", worker_id=worker_id)
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            worker.num_inflight -= 1
            worker.num_inflight_tokens -= n
            parts, flight.parts = list(flight.parts.values()), {}
            if not finished and not flight.aborted:
                await self._abort_parts(parts)

    @staticmethod
    def _worker_aborted(flight: _Flight, output: RequestOutput) -> bool:
        """A worker that ends a request with "abort" on its own (draining, dying) failed it."""
        return output.finished and output.finish_reason == "abort" and not flight.aborted

    @staticmethod
    def _aborted_output(flight: _Flight) -> RequestOutput:
        return RequestOutput(
            request_id=flight.request_id, new_token_ids=[], new_text="", finished=True, finish_reason="abort",
            num_prompt_tokens=flight.num_prompt_tokens, num_output_tokens=len(flight.sent_token_ids),
        )

    # ---------------------------------------------------------------- feedback to the policy

    def _report_outcome(self, flight: _Flight, arrival: float, first_token: float | None, num_tokens: int) -> None:
        """Tells the policy how a finished request went (module docstring); never raises."""
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
            self.policy.observe_outcome(outcome)
        except Exception:
            logger.warning("policy %s: observe_outcome failed for request %s; the request is unaffected",
                           self.policy.name, flight.request_id, exc_info=True)
            return
        self._set_calibration_gauges()

    def _set_calibration_gauges(self) -> None:
        if self.metrics is None:
            return
        try:
            factors = self.policy.calibration_factors()
            for name, value in factors.items():
                self.metrics.policy_calibration_factor.labels(self.policy.name, name).set(value)
        except Exception:
            logger.warning("policy %s: calibration_factors failed", self.policy.name, exc_info=True)

    # ---------------------------------------------------------------- helpers

    async def _abort_parts(self, parts: Sequence[_Part]) -> None:
        """Best-effort Abort on each part, each bounded by rpc_timeout_s; finishes even if the caller is cancelled."""
        if not parts:
            return
        task = self._spawn(asyncio.gather(*(self._abort_one(client, wire_id) for client, wire_id in parts)))
        await asyncio.shield(task)

    async def _abort_one(self, client: WorkerClient, wire_id: str) -> None:
        try:
            await client.abort(wire_id)
        except Exception as exc:
            # it may never have reached the worker (stopped, unreachable, its channel closed as it
            # left the directory): the worker's next good poll sends it again (WorkerPool.abort_later)
            logger.info("abort of %s on worker %s failed: %s", wire_id, client.worker_id, exc)
            if isinstance(exc, WorkerFailed):
                self.pool.abort_later(client.worker_id, wire_id)

    def _spawn(self, awaitable: Any) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(awaitable)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def precision_of(self, decision: Decision) -> str:
        """The KV's precision on the wire for a disaggregated `decision`: the policy's choice
        (`Decision.kv_precision`) under --kv-wire-precision auto, else the switch's."""
        if self.kv_wire_precision != "auto":
            return self.kv_wire_precision
        return getattr(decision, "kv_precision", "full")  # a policy's own decision type may lack it

    def _record_transfer(self, link: str, kv_bytes: int, kv_seconds: float, phases: dict[str, float] | None = None) -> None:
        if self.metrics is not None and kv_bytes:
            self.metrics.kv_transfer_bytes.labels(link).inc(kv_bytes)
            self.metrics.kv_transfer_seconds.labels(link).observe(kv_seconds)
            for phase, seconds in (phases or {}).items():
                self.metrics.kv_transfer_phase_seconds.labels(phase=phase).observe(seconds)

    def _record_first_token_phases(self, reserve_s: float, prefill_rpc_s: float, result: PrefillResult) -> None:
        """Where a disaggregated first token's time went: D's Reserve, P's queue and prefill up
        to the first token, the KV still in flight after it, and the rest of the Prefill RPC."""
        if self.metrics is None:
            return
        kv_tail = max(0.0, result.kv_seconds - result.kv_phases.get("stage", result.kv_seconds))
        phases = {"reserve": reserve_s, "prefill": result.prefill_seconds, "kv_tail": kv_tail,
                  "rpc": max(0.0, prefill_rpc_s - result.prefill_seconds - kv_tail)}
        for phase, seconds in phases.items():
            self.metrics.first_token_phase_seconds.labels(phase=phase).observe(seconds)

    @staticmethod
    def _timing(decision: Decision, reserve_s: float, prefill_rpc_s: float, result: PrefillResult) -> dict[str, Any]:
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

    def _count_recovery(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.request_recoveries.labels(kind).inc()

