"""The router's view of its workers: membership from the directory, health and stats by polling.

Each `refresh` (every `interval_s` in the background once started):
1. re-reads the directory: new workers are connected, a worker whose address changed (it
   restarted) gets a new connection (the old one is closed, so its streams fail and migrate),
   workers gone from the directory are dropped;
2. polls Health and Stats of every worker, each bounded by `health_timeout_s`. A worker that
   does not answer is marked unhealthy and its live calls are cancelled (that is how a hung or
   dead worker is detected mid-stream); one that answers "unhealthy" is avoided but its streams
   are left to end on their own; one that answers healthy is used again.
Request paths also `mark_down` a worker when a call to it fails; the next good poll restores it.

Unsent aborts: an Abort that did not reach its worker (stopped, SIGSTOP, or unreachable while the
router gave up on a request there, or the directory dropped it meanwhile and its connection was
closed) is kept (`abort_later`) and sent again after the worker's next good poll, also when it
comes back under the same id: nothing else would free what the request holds there soon (a
decode worker leases a reservation for the router's whole queue bound plus the KV deadline).
Kept at most UNSENT_ABORT_TTL_S (past any such lease), MAX_UNSENT_ABORTS per worker.

Draining: a directory may name workers to drain (a `draining` set of worker ids, e.g.
`pdserve.launcher.cluster.directory.RayDirectory` while the autoscaler removes one). A draining worker
keeps its connection and its live requests, but `snapshots()` leave it out, so that placement
sends it nothing new.

Warming: a worker that turns healthy (it joined, or came back) is handed to `on_healthy` when
set (the cluster backend sets it during its own warm-up, once every worker had its one-token
Generate); while that keeps the worker's
`warming` flag, `snapshots()` leave it out too. The backend uses it to move a first KV block
over each of the worker's prefill-decode pairs: before placement sends a new worker a request,
beside its requests for one that is back after a failed check (leaving it out then would keep
a cluster's last decode worker from serving while a dead peer's pair times out).

Duties: a directory may give a mixed worker a role to play (`duties`, worker id -> role;
router.cluster.directory): the pool then counts and places it as that role (`PooledWorker.role`,
its snapshots), while its connection and its own requests stay as they were. A duty given to a
worker that is not mixed is ignored with a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.proto import worker_pb2 as pb
from pdserve.router.cluster.directory import WorkerDirectory, WorkerEndpoint, check_duty
from pdserve.router.errors import WorkerError, WorkerFailed
from pdserve.router.placement.base import WorkerSnapshot
from pdserve.router.cluster.worker_client import WorkerClient

logger = logging.getLogger(__name__)

MAX_UNSENT_ABORTS = 10_000  # per worker: Aborts kept to send again once it answers (WorkerPool.abort_later)
UNSENT_ABORT_TTL_S = 1800.0  # how long such an Abort is kept for a worker that does not answer


@dataclass
class PooledWorker:
    """A worker as the router tracks it: where it is, its last stats, and its health."""

    endpoint: WorkerEndpoint
    client: WorkerClient
    healthy: bool = False
    detail: str = "not checked yet"
    stats: pb.StatsResponse | None = None
    num_inflight: int = 0  # requests the router has sent here and not seen end
    num_inflight_tokens: int = 0  # their prompt tokens
    role_mismatch_logged: bool = False
    draining: bool = False  # placement skips it; its requests run to their end
    duty: str | None = None  # a mixed worker's role override (the directory's `duties`); None: its own
    refused_duty: str | None = None  # the last duty ignored (not mixed), warned about once
    warming: bool = False  # healthy, its KV pairs being warmed (WorkerPool.on_healthy): not placed yet
    joined: bool = True  # not healthy yet since it entered the directory (or moved to a new address)

    @property
    def role(self) -> str:
        """The role the router counts and places it as: its duty, else the endpoint's role."""
        return self.duty or self.endpoint.role

    @property
    def is_empty(self) -> bool:
        """No request of the router's on it and none in its engine (queued, running, KV held or awaited)."""
        s = self.stats
        return self.num_inflight == 0 and s is not None and (
            s.num_waiting + s.num_running + s.num_held + s.num_awaiting_kv == 0)

    @property
    def worker_id(self) -> str:
        return self.endpoint.worker_id

    def snapshot(self) -> WorkerSnapshot:
        s = self.stats or pb.StatsResponse()
        return WorkerSnapshot(
            worker_id=self.worker_id,
            role=self.role,  # type: ignore[arg-type]
            node=self.endpoint.node,
            healthy=self.healthy,
            num_waiting=s.num_waiting + s.num_awaiting_kv,
            num_running=s.num_running,
            num_free_blocks=s.num_free_blocks,
            num_blocks=s.num_blocks,
            block_size=s.block_size,
            num_inflight=self.num_inflight,
            num_inflight_tokens=self.num_inflight_tokens,
            max_model_len=s.max_model_len,
            tokens_per_second=s.tokens_per_second,
            tensor_parallel_size=max(1, s.tensor_parallel_size),  # 0: a worker from before the field
            kv_compat=s.kv_compat,
        )


class WorkerPool:
    """The workers of one directory (module docstring). `workers` maps worker id -> PooledWorker."""

    def __init__(
        self, directory: WorkerDirectory, *, interval_s: float = 0.5, health_timeout_s: float = 2.0,
        rpc_timeout_s: float = 5.0, cluster_token: str | None = None,
    ) -> None:
        for name, value in (("interval_s", interval_s), ("health_timeout_s", health_timeout_s),
                            ("rpc_timeout_s", rpc_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self.directory = directory
        self.interval_s = float(interval_s)
        self.health_timeout_s = float(health_timeout_s)
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.workers: dict[str, PooledWorker] = {}
        self._cluster_token = cluster_token
        self._monitor: asyncio.Task[None] | None = None
        # called with a worker that turned healthy and whether it is new (joined, or moved to a
        # new address) rather than back after a failed check; while it sets the worker's
        # `warming`, placement leaves the worker out (the backend warms its KV pairs)
        self.on_healthy: Callable[[PooledWorker, bool], None] | None = None
        # worker id -> {request id its Abort did not reach: when it was kept}
        self._unsent_aborts: dict[str, dict[str, float]] = {}

    async def start(self) -> None:
        """One refresh now, then one every interval_s in the background."""
        await self.refresh()
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._monitor_loop(), name="worker-pool-monitor")

    def stop_monitoring(self) -> None:
        """No more background rounds (shutting down: a worker that stops now is no news); `close`
        still closes the connections."""
        if self._monitor is not None:
            self._monitor.cancel()

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        for worker in self.workers.values():
            await worker.client.close()

    async def refresh(self) -> None:
        await self._sync_endpoints()
        self._expire_unsent_aborts()
        await asyncio.gather(*(self._poll(w) for w in list(self.workers.values())))

    def snapshots(self) -> tuple[WorkerSnapshot, ...]:
        return tuple(w.snapshot() for w in self.workers.values() if not w.draining and not w.warming)

    def describe(self) -> dict[str, dict[str, Any]]:
        """Per worker: role, address, node, healthy, inflight and (when unhealthy) why."""
        info: dict[str, dict[str, Any]] = {}
        for w in self.workers.values():
            info[w.worker_id] = {"role": w.endpoint.role, "address": w.endpoint.address, "node": w.endpoint.node,
                                 "healthy": w.healthy, "inflight": w.num_inflight}
            if w.draining:
                info[w.worker_id]["draining"] = True
            if w.warming:
                info[w.worker_id]["warming"] = True
            if w.duty:
                info[w.worker_id]["duty"] = w.duty
            if w.detail:
                info[w.worker_id]["detail"] = w.detail
        return info

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:
                logger.exception("worker monitor round failed")

    async def _sync_endpoints(self) -> None:
        try:
            endpoints = await asyncio.wait_for(self.directory.endpoints(), self.health_timeout_s)
        except Exception as exc:
            logger.warning("worker directory failed (%s); keeping the last view of %d workers", exc, len(self.workers))
            return
        seen = {e.worker_id for e in endpoints}
        draining = getattr(self.directory, "draining", ())
        duties = getattr(self.directory, "duties", {})
        for endpoint in endpoints:
            worker = self.workers.get(endpoint.worker_id)
            if worker is None:
                logger.info("worker %s (%s) at %s", endpoint.worker_id, endpoint.role, endpoint.address)
                self.workers[endpoint.worker_id] = PooledWorker(endpoint, self._connect(endpoint))
            elif worker.endpoint != endpoint:
                logger.info("worker %s moved: %s -> %s", endpoint.worker_id, worker.endpoint.address, endpoint.address)
                old = worker.client
                worker.endpoint, worker.client = endpoint, self._connect(endpoint)
                worker.healthy, worker.detail, worker.stats = False, "moved, not checked yet", None
                worker.joined = True
                await old.close()  # its streams raise WorkerFailed and migrate
        for worker in self.workers.values():
            if worker.draining != (worker.worker_id in draining):
                worker.draining = worker.worker_id in draining
                logger.info("worker %s %s", worker.worker_id, "is draining" if worker.draining else "serves again")
            self._apply_duty(worker, duties.get(worker.worker_id))
        for worker_id in [w for w in self.workers if w not in seen]:
            logger.info("worker %s left the directory", worker_id)
            await self.workers.pop(worker_id).client.close()

    def _apply_duty(self, worker: PooledWorker, duty: str | None) -> None:
        if duty == worker.endpoint.role:
            duty = None
        if duty is not None:
            try:
                check_duty(worker.worker_id, worker.endpoint.role, duty)
            except ValueError as exc:
                if worker.refused_duty != duty:  # once per refused duty
                    logger.warning("ignoring a duty: %s", exc)
                    worker.refused_duty = duty
                duty = None
        if duty != worker.duty:
            logger.info("worker %s (%s) now serves as %s", worker.worker_id, worker.endpoint.role,
                        duty or worker.endpoint.role)
            worker.duty = duty

    def _connect(self, endpoint: WorkerEndpoint) -> WorkerClient:
        return WorkerClient(endpoint.worker_id, endpoint.address, rpc_timeout_s=self.rpc_timeout_s,
                            cluster_token=self._cluster_token)

    async def _poll(self, worker: PooledWorker) -> None:
        client = worker.client
        try:
            health, stats = await asyncio.gather(
                client.health(timeout_s=self.health_timeout_s), client.stats(timeout_s=self.health_timeout_s)
            )
        except WorkerError as exc:
            if worker.client is client:  # not replaced meanwhile
                self.mark_down(worker, str(exc), cancel_streams=True)
            return
        if worker.client is not client:
            return
        worker.stats = stats
        if not health.healthy:
            # it answers, so it can still end its own streams: they are not cancelled
            self.mark_down(worker, f"reports unhealthy: {health.detail or 'no detail'}", cancel_streams=False)
            return
        if stats.role and stats.role != worker.endpoint.role and not worker.role_mismatch_logged:
            worker.role_mismatch_logged = True
            logger.warning("worker %s reports role %r, the directory says %r",
                           worker.worker_id, stats.role, worker.endpoint.role)
        turned = not worker.healthy
        if turned:
            logger.info("worker %s is healthy", worker.worker_id)
        worker.healthy, worker.detail = True, ""
        joined, worker.joined = worker.joined, False
        if turned and self.on_healthy is not None and not worker.warming:
            try:
                self.on_healthy(worker, joined)
            except Exception:
                logger.exception("on_healthy hook failed for worker %s", worker.worker_id)
                worker.warming = False
        if self._unsent_aborts.get(worker.worker_id):
            await self._resend_aborts(worker)

    def abort_later(self, worker_id: str, request_id: str) -> None:
        """An Abort of `request_id` that did not reach worker `worker_id`: sent again after the
        worker's next good poll (module docstring, "Unsent aborts")."""
        pending = self._unsent_aborts.setdefault(worker_id, {})
        if len(pending) < MAX_UNSENT_ABORTS:
            pending.setdefault(request_id, time.monotonic())

    def _expire_unsent_aborts(self) -> None:
        too_old = time.monotonic() - UNSENT_ABORT_TTL_S
        for worker_id in list(self._unsent_aborts):
            pending = {rid: t for rid, t in self._unsent_aborts[worker_id].items() if t > too_old}
            if pending:
                self._unsent_aborts[worker_id] = pending
            else:
                del self._unsent_aborts[worker_id]

    async def _resend_aborts(self, worker: PooledWorker) -> None:
        pending = self._unsent_aborts.pop(worker.worker_id, {})
        request_ids = sorted(pending)
        results = await asyncio.gather(*(worker.client.abort(rid, timeout_s=self.rpc_timeout_s) for rid in request_ids),
                                       return_exceptions=True)
        found = 0
        for rid, result in zip(request_ids, results):
            if isinstance(result, WorkerFailed):  # not reached again: the next good poll retries
                self._unsent_aborts.setdefault(worker.worker_id, {}).setdefault(rid, pending[rid])
            elif not isinstance(result, BaseException):
                found += bool(result)
        logger.info("worker %s: %d unsent aborts sent again, %d of them found the request there",
                    worker.worker_id, len(request_ids), found)

    def mark_down(self, worker: PooledWorker, reason: str, *, cancel_streams: bool) -> None:
        if worker.healthy:
            logger.warning("worker %s is unhealthy: %s", worker.worker_id, reason)
        worker.healthy, worker.detail = False, reason
        if cancel_streams:
            worker.client.cancel_calls(f"worker {worker.worker_id} is unreachable ({reason})")
