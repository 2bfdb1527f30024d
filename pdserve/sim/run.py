"""One simulated load run: a workload in, finished requests (and loadgen records) out."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable

from pdserve.loadgen.records import RequestRecord
from pdserve.router.placement.base import PlacementPolicy
from pdserve.sim.cluster import SimCluster, build_sim_policy
from pdserve.sim.config import ClusterConfig
from pdserve.sim.events import EventLoop
from pdserve.sim.worker import SimRequest


@dataclass(frozen=True)
class Arrival:
    """One request of a workload: when it is sent, its prompt tokens and `max_tokens`."""

    offset_s: float
    prompt_tokens: int
    max_tokens: int
    prompt_tokens_est: int | None = None
    group: int | None = None
    prefix_key: object = None  # arrivals with the same key send the same prompt (prefix caching: sim.worker)


@dataclass
class SimRun:
    requests: list[SimRequest]
    num_events: int
    wall_s: float
    sim_end_s: float
    decisions: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    kv_bytes: int = 0
    kv_seconds: float = 0.0
    free_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)  # worker -> (free, total) at the end


def simulate(config: ClusterConfig, policy: str | PlacementPolicy, arrivals: Iterable[Arrival], *, seed: int = 0,
             record_tokens: bool = True, max_run_time_s: float | None = None, keep: bool = True,
             on_complete=None) -> SimRun:
    """Runs `arrivals` through a cluster placed by `policy` (a registered name, or a policy
    object). With `max_run_time_s`, requests unfinished then are recorded as cancelled (as
    loadgen's run bound does)."""
    loop = EventLoop()
    done: list[SimRequest] = []

    def complete(request: SimRequest) -> None:
        if keep:
            done.append(request)
        if on_complete is not None:
            on_complete(request)

    placement = policy if isinstance(policy, PlacementPolicy) else build_sim_policy(policy, config, seed=seed)
    cluster = SimCluster(loop, config, placement, complete)
    submitted: list[SimRequest] = []
    source = iter(enumerate(arrivals))

    def feed(_arg=None) -> None:
        """Submits the next arrival; each arrival schedules the one after it, so the heap and
        memory hold the requests in flight, not the whole trace."""
        item = next(source, None)
        if item is None or (max_run_time_s is not None and item[1].offset_s >= max_run_time_s):
            cluster.arrivals_left -= 1  # the feed's own count: no more arrivals
            return
        i, a = item
        request = SimRequest(i, a.offset_s, a.prompt_tokens, a.max_tokens, record_tokens=record_tokens)
        request.prompt_tokens_est = a.prompt_tokens_est
        request.group = a.group
        request.prefix_key = a.prefix_key
        if keep:
            submitted.append(request)
        cluster.submit(request)
        loop.at(a.offset_s, feed)

    cluster.arrivals_left += 1
    feed()
    start = time.perf_counter()
    loop.run(until=max_run_time_s if max_run_time_s is not None else math.inf)
    wall = time.perf_counter() - start
    if keep and max_run_time_s is not None:
        finished = {id(r) for r in done}
        for request in submitted:
            if id(request) not in finished:
                request.error = "cancelled"
                request.status_code = None  # type: ignore[assignment]
                done.append(request)
    done.sort(key=lambda r: r.index)
    kv = [r for r in done if r.kv_seconds is not None]
    return SimRun(
        requests=done, num_events=loop.num_events, wall_s=wall, sim_end_s=loop.now,
        decisions=dict(cluster.decisions),
        num_preemptions=sum(w.num_preemptions for w in cluster.workers.values()),
        kv_bytes=sum(r.kv_bytes for r in kv), kv_seconds=sum(r.kv_seconds for r in kv),
        free_blocks={wid: (w.num_free_blocks, w.num_blocks) for wid, w in cluster.workers.items()},
    )


def to_record(request: SimRequest) -> RequestRecord:
    """The request as loadgen's client would have recorded it (times relative to `sent_s`)."""
    sent = request.sent
    ok = request.error is None
    first = request.first_token_time
    last = request.last_token_time
    times = [t - sent for t in request.token_times] if request.token_times is not None else []
    return RequestRecord(
        index=request.index, request_id=request.request_id, scheduled_s=request.arrival, sent_s=sent,
        ttft_s=first - sent if first is not None else None,
        e2e_s=last - sent if ok and last is not None else None,
        token_times_s=times, prompt_tokens=request.num_prompt_tokens,
        completion_tokens=request.num_output_tokens if ok else None,
        token_count_source="usage" if ok else None, prompt_tokens_est=request.prompt_tokens_est,
        max_tokens=request.max_tokens, status=request.status_code, error=request.error,
        server_request_id=request.request_id,
        kv_bytes=float(request.kv_bytes) if request.kv_seconds is not None else None,
        kv_seconds=request.kv_seconds, group=request.group,
    )
