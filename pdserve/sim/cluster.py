"""The simulated router and the request lifecycle, over simulated workers and links.

Lifecycle of a request (as `pdserve/router/cluster/backend.py` drives it in a real cluster):

1. Arrival: the router builds a `ClusterSnapshot` (each worker's last polled stats, its own
   in-flight counts, the link states of the real `pdserve.router.placement.congestion.LinkMonitor`) and asks
   the real placement policy. NoWorkersAvailable is a 503, SLOUnattainable a 429.
2. Disaggregated (P, D; in a hybrid cluster both are mixed workers, router mode disaggregated):
   the in-flight counts of P and D and the P->D flow count from the decision. D reserves
   blocks for the prompt (none free: D is excluded and the request is placed again, up to
   `max_retries`), then P queues the prefill.
3. P's steps compute the prompt; each step's share of the prompt's KV streams to D while the
   step computes (the flow is capped at the rate the step produces KV; the first step also
   makes a prefix-cache hit's KV ready), the rest after it at
   the link's fair share. The transfer ends when the last byte and the link latency are past
   and the compute is done; then P frees its blocks, the router records the transfer with
   the monitor (`finish`, with kv_seconds and prefill_seconds as a real worker reports them)
   and sends the first token: the client's TTFT.
4. D commits the request into its batch and streams the other tokens; the last one ends it.
5. Local (or colocated): the whole request on D (prefill chunks share D's steps).

Every router<->worker call adds `rpc_s` (one way); `front_s` delays each request's placement
after its send (the client -> router path: HTTP, tokenising the prompt), so it adds to TTFT.

6. The end of a request that finished: the router reports its `Outcome` (where it ran, TTFT
   from its send (front_s included), TPOT, the prefill worker's prefill from its first chunk to
   its last, as a real worker reports it without its queue) to `policy.observe_outcome`, as
   the real backend does, so that a learning policy (network-aware's calibration) runs here
   as it runs in a cluster.
"""

from __future__ import annotations

import math
from typing import Callable

from pdserve.router.placement.congestion import CongestionView, LinkMonitor
from pdserve.router.placement.base import (
    ClusterSnapshot,
    NoWorkersAvailable,
    Outcome,
    PlacementPolicy,
    RequestInfo,
    SLOUnattainable,
    WorkerSnapshot,
)
from pdserve.router.placement.registry import make_policy
from pdserve.router.placement.policies.cost import FP8_WIRE_RATIO
from pdserve.router.placement.policies.network_aware import NetworkAware
from pdserve.sim.config import ClusterConfig
from pdserve.sim.events import EventLoop
from pdserve.sim.fluid import Flow, FluidResource
from pdserve.sim.worker import SimRequest, SimWorker, StepCosts

_EMPTY_LINKS = CongestionView()


def build_sim_policy(name: str, config: ClusterConfig, *, seed: int = 0) -> PlacementPolicy:
    """The registered policy `name` with the cluster file's options for it; network-aware gets
    the cluster's profile and topology unless the options say otherwise."""
    options = dict(config.router.policy_options.get(name, {}))
    if name == NetworkAware.name:
        options.setdefault("profile", config.profile)
        options.setdefault("topology", config.topology)
    elif name in ("random", "power-of-two"):
        options.setdefault("seed", seed)
    policy = make_policy(name, **options)
    if policy.topology is None:
        policy.topology = config.topology
    return policy


class SimCluster:
    """Workers, links and the router of one simulated cluster (module docstring)."""

    def __init__(self, loop: EventLoop, config: ClusterConfig, policy: PlacementPolicy,
                 on_complete: Callable[[SimRequest], None]) -> None:
        self.loop = loop
        self.config = config
        self.policy = policy
        self.on_complete = on_complete
        self.topology = config.topology
        self.kv_bytes_per_token_true = config.profile.kv_bytes_per_token
        self.kv_bytes_per_token_seen = 0
        costs: dict[tuple[str, int], StepCosts] = {}  # (profile role, tp) -> memoized costs

        def costs_of(role: str, tp: int) -> StepCosts:
            which = "prefill" if role == "prefill" or not config.decode_profile else "decode"
            if (which, tp) not in costs:
                costs[which, tp] = StepCosts(config.profile if which == "prefill" else config.decode_profile, tp)
            return costs[which, tp]

        self.hosts = {name: FluidResource(loop, cores, f"host {name}") for name, cores in config.hosts.items()}
        limits = config.engine
        self.workers: dict[str, SimWorker] = {}
        for w in config.workers:
            worker = SimWorker(
                loop, w.worker_id, w.role, node=self.topology.node_of(w.worker_id, w.node),
                num_blocks=limits.num_blocks * w.tp, block_size=limits.block_size,
                max_num_batched_tokens=limits.max_num_batched_tokens, max_num_seqs=limits.max_num_seqs,
                overlap_steps=limits.overlap_steps, costs=costs_of(w.role, w.tp),
                host=self.hosts[w.host] if w.host else None,
            )
            worker.on_token = self._on_token
            worker.on_finished = self._on_finished
            worker.on_prefilled = self._on_prefilled
            worker.on_chunk = self._on_chunk
            self.workers[w.worker_id] = worker
        self.monitor = LinkMonitor()
        self.links: dict[str, FluidResource] = {}
        self._latency: dict[str, float] = {}
        self.needs_links = isinstance(policy, NetworkAware)
        # the router's view: in-flight counts now, worker stats as of the last poll
        self._inflight = {wid: [0, 0] for wid in self.workers}
        self._stats = {wid: (0, 0, limits.num_blocks) for wid in self.workers}
        self._ids = sorted(self.workers)
        self._tp = {w.worker_id: w.tp for w in config.workers}
        self._index = {wid: i for i, wid in enumerate(self._ids)}
        self._snaps: list[WorkerSnapshot | None] = [None] * len(self._ids)
        self._snap_tuple: tuple[WorkerSnapshot, ...] | None = None
        self.outstanding = 0
        self.arrivals_left = 0
        self.num_placements = 0
        self.decisions: dict[str, int] = {}
        self._polling = False

    # ---------------------------------------------------------------- arrivals

    def submit(self, request: SimRequest) -> None:
        """Schedules `request`'s arrival (its `arrival` time)."""
        self.arrivals_left += 1
        self.loop.at(request.arrival, self._arrive, request)
        if not self._polling:
            self._polling = True
            self.loop.at(self.loop.now, self._poll)

    def _arrive(self, request: SimRequest) -> None:
        self.arrivals_left -= 1
        self.outstanding += 1
        request.sent = self.loop.now
        front = self.config.router.front_s
        if front > 0:
            self.loop.after(front, self._place, request)
        else:
            self._place(request)

    # ---------------------------------------------------------------- the router's view

    def _poll(self, _arg=None) -> None:
        """Every stats_interval_s: each worker's Stats answer, as the real WorkerPool polls it."""
        for wid, worker in self.workers.items():
            stats = (len(worker.waiting) + worker.num_awaiting, len(worker.running), worker.num_free_blocks)
            if stats != self._stats[wid]:
                self._stats[wid] = stats
                self._dirty(wid)
        if self.outstanding or self.arrivals_left:
            interval = self.config.router.stats_interval_s
            if interval > 0:
                self.loop.after(interval, self._poll)
        else:
            self._polling = False

    def _dirty(self, worker_id: str) -> None:
        self._snaps[self._index[worker_id]] = None
        self._snap_tuple = None

    def _snapshot_of(self, worker_id: str) -> WorkerSnapshot:
        worker = self.workers[worker_id]
        if self.config.router.stats_interval_s == 0:  # stats exact at every decision
            waiting, running, free = (len(worker.waiting) + worker.num_awaiting, len(worker.running),
                                      worker.num_free_blocks)
        else:
            waiting, running, free = self._stats[worker_id]
        count, tokens = self._inflight[worker_id]
        return WorkerSnapshot(
            worker_id=worker_id, role=worker.role, node=worker.node, healthy=worker.healthy,  # type: ignore[arg-type]
            num_waiting=waiting, num_running=running, num_free_blocks=free, num_blocks=worker.num_blocks,
            block_size=worker.block_size, num_inflight=count, num_inflight_tokens=tokens,
            tensor_parallel_size=self._tp[worker_id],
        )

    def snapshot(self) -> ClusterSnapshot:
        if self.config.router.stats_interval_s == 0:
            snaps = tuple(self._snapshot_of(wid) for wid in self._ids)
        else:
            if self._snap_tuple is None:
                for i, snap in enumerate(self._snaps):
                    if snap is None:
                        self._snaps[i] = self._snapshot_of(self._ids[i])
                self._snap_tuple = tuple(self._snaps)  # type: ignore[arg-type]
            snaps = self._snap_tuple
        links = self.monitor.view() if self.needs_links else _EMPTY_LINKS
        return ClusterSnapshot(snaps, mode=self.config.mode, topology=self.topology, links=links,  # type: ignore[arg-type]
                               kv_bytes_per_token=self.kv_bytes_per_token_seen, now=self.loop.now)

    def _count(self, worker_id: str, request: SimRequest, sign: int) -> None:
        entry = self._inflight[worker_id]
        entry[0] += sign
        entry[1] += sign * request.num_prompt_tokens
        self._dirty(worker_id)

    # ---------------------------------------------------------------- placement

    def _place(self, request: SimRequest) -> None:
        info = RequestInfo(request_id=request.request_id, num_prompt_tokens=request.num_prompt_tokens,
                           max_tokens=request.max_tokens, excluded=request.excluded)
        try:
            decision = self.policy.place(info, self.snapshot())
        except SLOUnattainable as exc:
            self._fail(request, 429, f"The cluster cannot serve the request within its SLOs now ({exc})")
            return
        except NoWorkersAvailable as exc:
            self._fail(request, 503, f"No worker can serve the request: {exc}")
            return
        self.num_placements += 1
        key = decision.kind if decision.prefill is None else f"{decision.prefill}->{decision.decode}"
        self.decisions[key] = self.decisions.get(key, 0) + 1
        request.decision = decision
        decode = self.workers[decision.decode]
        request.decode_worker = decode
        rpc = self.config.router.rpc_s
        if decision.prefill is None:
            self._count(decode.worker_id, request, +1)
            self.loop.after(rpc, decode.add, request)
            return
        prefill = self.workers[decision.prefill]
        request.prefill_worker = prefill
        self._count(decode.worker_id, request, +1)
        self._count(prefill.worker_id, request, +1)
        link = self.topology.link(prefill.node, decode.node)
        request.monitor_flow = self.monitor.start(link.key,
                                                  request.num_prompt_tokens * self._wire_bytes_per_token(request))
        self.loop.after(rpc, self._reserve, request)

    def _reserve(self, request: SimRequest) -> None:
        decode, prefill = request.decode_worker, request.prefill_worker
        if not decode.reserve(request):
            self._count(decode.worker_id, request, -1)
            self._count(prefill.worker_id, request, -1)
            self.monitor.finish(request.monitor_flow)
            if request.retries >= self.config.router.max_retries:
                self._fail(request, 503, f"worker {decode.worker_id} has no free KV blocks for "
                                         f"{request.num_prompt_tokens} tokens (retries exhausted)")
                return
            request.retries += 1
            request.excluded = request.excluded | {decode.worker_id}
            self.loop.after(self.config.router.rpc_s, self._place, request)
            return
        self.loop.after(self.config.router.rpc_s, self._start_prefill, request)

    def _start_prefill(self, request: SimRequest) -> None:
        request.prefill_rpc_start = self.loop.now
        request.prefill_worker.add(request)

    # ---------------------------------------------------------------- KV transfer

    def _wire_bytes_per_token(self, request: SimRequest) -> float:
        """KV bytes per prompt token on the wire: FP8 (Decision.kv_precision) moves FP8_WIRE_RATIO
        of them (the quantize and dequantize time is not simulated: a few ms on a GPU)."""
        if getattr(request.decision, "kv_precision", "full") == "fp8":
            return self.kv_bytes_per_token_true * FP8_WIRE_RATIO
        return self.kv_bytes_per_token_true

    def _link(self, src: str, dst: str) -> tuple[FluidResource, float]:
        link = self.topology.link(src, dst)
        resource = self.links.get(link.key)
        if resource is None:
            resource = self.links[link.key] = FluidResource(self.loop, link.capacity_gbps * 1e9 / 8, link.key)
            self._latency[link.key] = link.latency_ms / 1e3
        return resource, self._latency[link.key]

    def _on_chunk(self, worker: SimWorker, request: SimRequest, num_new: int, seconds: float) -> None:
        if request.kv_flow is None:  # the first chunk: a prefix-cache hit's KV is ready to send with it
            num_new += request.num_computed_tokens
        produced = num_new * self._wire_bytes_per_token(request) / seconds if seconds > 0 else math.inf
        if request.kv_flow is None:
            resource, _ = self._link(worker.node, request.decode_worker.node)
            request.kv_bytes = round(request.num_prompt_tokens * self._wire_bytes_per_token(request))
            request.kv_started = self.loop.now
            request.kv_flow = Flow(request.kv_bytes, self._on_kv_sent, cap=produced, owner=request)
            resource.add(request.kv_flow)
        elif request.kv_flow.resource is not None:
            request.kv_flow.resource.set_cap(request.kv_flow, produced)

    def _on_kv_sent(self, flow: Flow) -> None:
        request: SimRequest = flow.owner  # type: ignore[assignment]
        _, latency = self._link(request.prefill_worker.node, request.decode_worker.node)
        self.loop.after(latency, self._on_kv_landed, request)

    def _on_kv_landed(self, request: SimRequest) -> None:
        request.kv_sent = True
        if request.kv_compute_done:
            self._kv_done(request)

    def _on_prefilled(self, worker: SimWorker, request: SimRequest, now: float) -> None:
        request.prefilled_time = now
        request.kv_compute_done = True
        flow = request.kv_flow
        if request.kv_sent:
            self._kv_done(request)
        elif flow is not None and flow.resource is not None:
            flow.resource.set_cap(flow, math.inf)

    def _kv_done(self, request: SimRequest) -> None:
        now = self.loop.now
        prefill = request.prefill_worker
        prefill.release(request)
        self._count(prefill.worker_id, request, -1)
        request.kv_seconds = now - request.kv_started
        self.monitor.finish(request.monitor_flow, kv_bytes=request.kv_bytes, kv_seconds=request.kv_seconds,
                            prefill_seconds=request.prefilled_time - request.prefill_rpc_start)
        self.kv_bytes_per_token_seen = self.kv_bytes_per_token_true
        self.loop.after(self.config.router.rpc_s, self._first_token, request)

    def _first_token(self, request: SimRequest) -> None:
        self._token(request, self.loop.now)
        decode = request.decode_worker
        if request.max_tokens <= 1:
            decode.cancel_reservation(request)
            self._count(decode.worker_id, request, -1)
            self._complete(request)
            return
        self.loop.after(self.config.router.rpc_s, decode.commit, request)

    # ---------------------------------------------------------------- tokens and the end

    def _token(self, request: SimRequest, now: float) -> None:
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        if request.token_times is not None:
            request.token_times.append(now)

    def _on_token(self, worker: SimWorker, request: SimRequest, now: float) -> None:
        self._token(request, now)  # on D after a hand-off these are tokens 2.. (the first came from P)

    def _on_finished(self, worker: SimWorker, request: SimRequest, now: float) -> None:
        self._count(worker.worker_id, request, -1)
        self._complete(request)

    def _fail(self, request: SimRequest, status: int, message: str) -> None:
        request.status_code = status
        request.error = message
        self._complete(request)

    def _complete(self, request: SimRequest) -> None:
        self.outstanding -= 1
        if request.error is None and request.decision is not None:
            self.policy.observe_outcome(outcome_of(request))
        self.on_complete(request)


def outcome_of(request: SimRequest) -> Outcome:
    """A finished request's outcome, as the real router measures it (module docstring, 6)."""
    decision = request.decision
    first, last, n = request.first_token_time, request.last_token_time, request.num_output_tokens
    disaggregated = decision.prefill is not None
    prefill_s = queue_s = None
    if disaggregated and request.prefilled_time is not None and request.kv_started is not None:
        prefill_s = request.prefilled_time - request.kv_started
        queue_s = request.kv_started - request.prefill_rpc_start
    return Outcome(
        request_id=request.request_id, placement="disaggregated" if disaggregated else "local",
        prefill_worker=decision.prefill, decode_worker=decision.decode, prompt_tokens=request.num_prompt_tokens,
        output_tokens=n, ttft_s=None if first is None else first - request.sent,
        tpot_s=(last - first) / (n - 1) if first is not None and last is not None and n > 1 else None,
        prefill_s=prefill_s, prefill_queue_s=queue_s, attempts=1 + request.retries,
    )
