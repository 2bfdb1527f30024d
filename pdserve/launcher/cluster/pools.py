"""Worker pools as named Ray actors, one placement group per pool.

Lifecycle (`ClusterPools`):

1. `start()`: per pool, reserve a placement group of one bundle per worker ({CPU, GPU, custom
   resources}); a pool that cannot be placed within the startup timeout is an error that names
   the pool and what it asked for. Then create the actors `pdserve:<cluster>:<role>:<i>` in
   the namespace, with `max_restarts=-1` so that Ray brings back a dead worker.
2. `wait_ready(timeout, progress)`: wait until each worker has loaded its model and serves;
   a worker whose constructor raised is an error naming the worker and the cause.
3. `stop_servers()`: stop every worker's server at once (bounded); they answer nothing after.
4. `shutdown()`: stop the servers unless done, kill the actors without restart, remove the
   placement groups. Idempotent. (A Ray that `pdserve up` started ends with its processes
   instead, `pdserve.launcher.cluster.up`: it may be going down already, and then answers no call.)

Resizing a running cluster (`pdserve.launcher.cluster.resize`) goes through `adopt` (a worker started
in a placement group of its own joins the pools, which then stop it and remove its group at
shutdown) and `release` (a worker leaves the pools; its group is handed back for removal when
no other worker is in it); `group_of` and `has_own_group` answer which group a worker is in.

Actors are not detached: they share the fate of the driver that created them (`pdserve up`),
so a driver that dies takes its workers with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import EngineConfig

logger = logging.getLogger(__name__)

NAME_PREFIX = "pdserve"


def actor_name(cluster: str, role: str, index: int) -> str:
    return f"{NAME_PREFIX}:{cluster}:{role}:{index}"


def parse_actor_name(name: str) -> tuple[str, str, int] | None:
    """(cluster, role, index) of a pool actor's name, None for other names."""
    parts = name.split(":")
    if len(parts) != 4 or parts[0] != NAME_PREFIX or not parts[3].isdigit():
        return None
    return parts[1], parts[2], int(parts[3])


class ClusterStartError(RuntimeError):
    """The pools could not be placed or a worker failed to start; the message says which."""


@dataclass(frozen=True)
class PoolSpec:
    role: str  # "prefill" | "decode" | "mixed"
    size: int
    engine: EngineConfig
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)  # custom Ray resources per worker
    strategy: str = "PACK"  # placement group strategy across the pool's workers
    kv_backend: str = "ucx"
    cluster_token: str | None = field(default=None, repr=False)  # handed to each worker
    moves_kv: bool = False  # mixed workers that also send and receive KV (--mode hybrid)
    # ranks per worker: num_cpus and num_gpus are per rank, a worker's bundle holds all its ranks
    # (one bundle is placed on one node)
    tensor_parallel_size: int = 1

    def bundle(self) -> dict[str, float]:
        tp = self.tensor_parallel_size
        bundle = {"CPU": float(self.num_cpus) * tp, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = float(self.num_gpus) * tp
        return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}


@dataclass
class PoolWorker:
    name: str
    role: str
    handle: Any
    pid: int | None = None  # its process when it was last seen ready (Ray may restart it since)


def short_error(exc: BaseException) -> str:
    """The last meaningful line of a Ray error (the original exception, not Ray's wrapping)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        if not set(line) <= set("^~ ") and not line.startswith(("File ", "Traceback")):
            return line
    return type(exc).__name__


class ClusterPools:
    def __init__(self, cluster: str, namespace: str, specs: list[PoolSpec]) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.specs = specs
        self.workers: list[PoolWorker] = []
        self._groups: list[Any] = []
        self._group_of: dict[str, Any] = {}  # worker name -> the placement group it was started in
        self._lock = threading.Lock()  # adopt and release run in the autoscaler's threads
        self._closed = False
        self._stopped = False  # stop_servers ran

    @property
    def names(self) -> list[str]:
        return [w.name for w in self.workers]

    def start(self, timeout_s: float = 600.0) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pdserve.launcher.cluster.ray_workers import WorkerActor
        from pdserve.launcher.workers import WorkerSpec, ray_actor

        remote_cls = ray.remote(WorkerActor)
        deadline = time.monotonic() + timeout_s
        for spec in self.specs:
            if spec.size <= 0:
                continue
            for index in range(spec.size):
                name = actor_name(self.cluster, spec.role, index)
                if _actor_exists(name, self.namespace):
                    raise ClusterStartError(
                        f"a worker named {name} already exists in Ray namespace {self.namespace!r} (another "
                        "pdserve up?); choose another --cluster-name or --namespace")
            bundle = spec.bundle()
            group = placement_group([dict(bundle) for _ in range(spec.size)], strategy=spec.strategy,
                                    name=f"{NAME_PREFIX}:{self.cluster}:{spec.role}")
            self._groups.append(group)
            ready, _ = ray.wait([group.ready()], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise ClusterStartError(
                    f"cannot place the {spec.role} pool ({spec.size} x {bundle}, {spec.strategy}) within "
                    f"{timeout_s:.0f}s; the Ray cluster has {_resources_summary(ray.cluster_resources())}")
            for index in range(spec.size):
                name = actor_name(self.cluster, spec.role, index)
                worker = WorkerSpec(role=spec.role, worker_id=name, kv_backend=spec.kv_backend,
                                    cluster_token=spec.cluster_token, moves_kv=spec.moves_kv,
                                    tensor_parallel_size=spec.tensor_parallel_size)
                options, args = ray_actor(
                    worker, spec.engine, namespace=self.namespace, num_cpus=spec.num_cpus, num_gpus=spec.num_gpus,
                    resources=spec.resources, scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=index))
                handle = remote_cls.options(**options).remote(*args)
                self.workers.append(PoolWorker(name, spec.role, handle))
                self._group_of[name] = group
                logger.info("created worker %s", name)

    def adopt(self, name: str, role: str, handle: Any, group: Any) -> PoolWorker:
        """A worker started outside `start` (its actor `handle`, in placement `group`) joins the
        pools: `shutdown` stops it and removes its group unless `release` hands them back first."""
        with self._lock:
            if any(w.name == name for w in self.workers):
                raise ValueError(f"a worker named {name} is already in the pools")
            worker = PoolWorker(name, role, handle)
            self.workers.append(worker)
            if all(g is not group for g in self._groups):
                self._groups.append(group)
            self._group_of[name] = group
        return worker

    def release(self, name: str) -> tuple[PoolWorker, Any | None]:
        """The worker leaves the pools (the caller stops and kills it); returns it and its
        placement group when no other worker is in that group (the caller removes it), else None.
        ValueError when no such worker is in the pools."""
        with self._lock:
            worker = next((w for w in self.workers if w.name == name), None)
            if worker is None:
                raise ValueError(f"no worker {name} in the pools")
            self.workers.remove(worker)
            group = self._group_of.pop(name, None)
            if group is None or any(g is group for g in self._group_of.values()):
                return worker, None
            self._groups[:] = [g for g in self._groups if g is not group]
            return worker, group

    def group_of(self, name: str) -> Any | None:
        """The placement group the worker was started in (None for an unknown worker)."""
        return self._group_of.get(name)

    def has_own_group(self, name: str) -> bool:
        """True when no other worker shares the worker's placement group (it was added alone)."""
        with self._lock:
            group = self._group_of.get(name)
            return group is not None and sum(1 for g in self._group_of.values() if g is group) == 1

    def wait_ready(self, timeout_s: float = 600.0,
                   on_ready: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, dict[str, Any]]:
        """Blocks until every worker answers `health()` healthy; returns name -> health.

        `on_ready(name, health)` is called as each one comes up (a progress bar)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        deadline = time.monotonic() + timeout_s
        pending = {w.handle.health.remote(): w for w in self.workers}
        ready: dict[str, dict[str, Any]] = {}
        while pending:
            remaining = deadline - time.monotonic()
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, remaining))
            if not done:
                missing = ", ".join(sorted(w.name for w in pending.values()))
                raise ClusterStartError(f"workers not ready within {timeout_s:.0f}s: {missing}")
            worker = pending.pop(done[0])
            try:
                health = ray.get(done[0], timeout=5)
            except (RayActorError, GetTimeoutError, RayError) as exc:
                raise ClusterStartError(f"worker {worker.name} failed to start: {short_error(exc)}") from None
            if not health.get("healthy"):
                raise ClusterStartError(f"worker {worker.name} is unhealthy: {health.get('detail')}")
            ready[worker.name] = health
            worker.pid = health.get("pid")
            if on_ready is not None:
                on_ready(worker.name, health)
        return ready

    def stop_servers(self, grace_s: float = 5.0, alive: Callable[[PoolWorker], bool] | None = None) -> None:
        """Stops every worker's server at once, bounded by grace_s overall (in-flight calls get
        half of it). Quick also under load: WorkerActor.stop leaves the KV plane and the
        engine's step in progress to the kill. `alive(worker)` False: its process is gone
        already, nothing to stop (a call to it would wait for a GCS that may be gone with it).
        Once only."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            workers = [w for w in self.workers if alive is None or alive(w)]
        import ray

        if not ray.is_initialized() or not workers:
            return
        stops = {}
        for w in workers:
            try:
                stops[w.name] = (w, w.handle.stop.remote(grace_s / 2))
            except Exception:  # its actor is gone
                logger.debug("stopping %s failed", w.name, exc_info=True)
        if not stops:
            return
        refs = [ref for _, ref in stops.values()]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        if len(done) < len(stops):
            late = [name for name, (w, ref) in stops.items() if ref not in done and (alive is None or alive(w))]
            if late:  # the others' processes ended meanwhile
                logger.warning("%d of %d workers did not stop within %.1fs; killing them: %s",
                               len(late), len(stops), grace_s, ", ".join(late))

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stops the servers unless `stop_servers` did (bounded by grace_s overall), kills the
        actors, removes the groups."""
        if self._closed:
            return
        self._closed = True
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        self.stop_servers(grace_s)
        for w in self.workers:
            try:
                ray.kill(w.handle, no_restart=True)
            except Exception:  # already gone
                logger.debug("killing %s failed", w.name, exc_info=True)
        for group in self._groups:
            try:
                remove_placement_group(group)
            except Exception:
                logger.debug("removing a placement group failed", exc_info=True)
        self.workers.clear()
        self._groups.clear()
        self._group_of.clear()


def _actor_exists(name: str, namespace: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def _resources_summary(resources: Mapping[str, float]) -> str:
    shown = {k: v for k, v in resources.items()
             if not k.startswith(("node:", "object_store_memory", "memory", "accelerator_type"))}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"
