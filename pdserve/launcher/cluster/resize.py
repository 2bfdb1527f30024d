"""Resizing the worker pools of a running `pdserve up` (the autoscaler's hands).

- `add(role)`: one more worker of the pool `role`, started the way `ClusterPools.start` starts
  them (`pdserve.launcher.workers.ray_actor`, the pool's `PoolSpec`), in a placement group of its own
  (one bundle: a running group cannot grow), named `pdserve:<cluster>:<role>:<i>` with an index
  never used before in this run; waits until it serves, then the router's directory follows it.
  The pools own it from then on (`ClusterPools.shutdown` stops it and removes its group).
- `drain(name)` then `remove(name)`: the directory marks it draining (placement skips it), the
  caller waits until the router's view of it is empty (`PooledWorker.is_empty`: nothing in
  flight, queued, running or KV held), then `remove` forgets it in the directory, stops its
  server, kills its actor and removes its placement group. A worker of the pool's first group
  shares that group: its bundle is released when the last of the group's workers leaves, or at
  shutdown.

- Warm spares: `prepare_spare(role)` starts a worker as `add` does but leaves it out of the
  directory (its actor says `standby`); `add(role)` takes a healthy spare of the pool first, so
  it only has to announce it (about a second, against a model load and a warm-up), and
  `park(name)` makes a drained worker a spare instead of removing it. Spares are in the pools
  (shutdown stops them) and hold their bundle.

- `shift(name, duty)`: a hybrid (mixed, KV-moving) worker takes prefill, decode or mixed duty:
  the directory's role override, which the router's pool applies (router.cluster.directory);
  no process starts or stops.

The Ray calls block: call `add` and `remove` from a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pdserve.launcher.cluster.pools import NAME_PREFIX, ClusterPools, ClusterStartError, actor_name, short_error

logger = logging.getLogger(__name__)


class PoolResizer:
    def __init__(self, pools: ClusterPools, directory: Any, *, start_timeout_s: float = 600.0) -> None:
        self.pools = pools
        self.directory = directory
        self.start_timeout_s = start_timeout_s
        self.specs = {spec.role: spec for spec in pools.specs}
        self._next_index = {spec.role: spec.size for spec in pools.specs}
        self._spares: dict[str, list[str]] = {spec.role: [] for spec in pools.specs}
        self._lock = threading.Lock()

    def workers(self, role: str) -> list[str]:
        return [w.name for w in self.pools.workers if w.role == role]

    def own_group(self, name: str) -> bool:
        """True when the worker has a placement group of its own (it was added)."""
        return self.pools.has_own_group(name)

    def spares(self, role: str) -> list[str]:
        """The pool's warm spares (started, not serving), oldest first."""
        with self._lock:
            return list(self._spares.get(role, ()))

    def add(self, role: str) -> str:
        """One more serving worker of `role`: a warm spare of the pool when one is healthy (the
        directory follows it from now on), else one started now; its name. ClusterStartError
        (nothing left behind) when a new one cannot be placed or does not start within the timeout."""
        while True:
            with self._lock:
                name = self._spares[role].pop(0) if self._spares.get(role) else None
            if name is None:
                break
            if self._promote(name):
                return name
        name = self._start(role, self.start_timeout_s)
        self.directory.add_worker(name)
        return name

    def prepare_spare(self, role: str, timeout_s: float | None = None) -> str:
        """Starts a warm spare of `role` (within `timeout_s`, default the start timeout); its name."""
        name = self._start(role, self.start_timeout_s if timeout_s is None else timeout_s, standby=True)
        with self._lock:
            self._spares[role].append(name)
        logger.info("worker %s is a warm spare of the %s pool", name, role)
        return name

    def park(self, name: str) -> None:
        """A drained worker stops serving but stays, warm, as a spare of its pool."""
        import ray

        worker = self._worker(name)
        self.directory.remove_worker(name)  # it stays in `draining` until promoted
        ray.get(worker.handle.set_standby.remote(True), timeout=30)
        with self._lock:
            self._spares[worker.role].append(name)
        logger.info("worker %s is parked as a warm spare of the %s pool", name, worker.role)

    def _worker(self, name: str) -> Any:
        worker = next((w for w in self.pools.workers if w.name == name), None)
        if worker is None:
            raise ValueError(f"no worker {name} in the pools")
        return worker

    def _promote(self, name: str) -> bool:
        """A spare serves: False (and it is removed) when it is not healthy."""
        import ray

        worker = self._worker(name)
        try:
            health = ray.get(worker.handle.health.remote(), timeout=10)
            healthy = bool(health.get("healthy"))
            if healthy:
                ray.get(worker.handle.set_standby.remote(False), timeout=10)
        except Exception as exc:
            logger.warning("warm spare %s does not answer (%s); it is removed", name, short_error(exc))
            healthy = False
        if not healthy:
            self.remove(name)
            return False
        self.directory.draining.discard(name)  # a parked worker was drained
        self.directory.add_worker(name)
        logger.info("warm spare %s serves", name)
        return True

    def _start(self, role: str, timeout_s: float, standby: bool = False) -> str:
        """Starts one worker of `role` in a placement group of its own and waits until it is
        healthy; the pools own it from then on, the directory does not follow it yet."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pdserve.launcher.cluster.ray_workers import WorkerActor
        from pdserve.launcher.workers import WorkerSpec, ray_actor

        spec = self.specs.get(role)
        if spec is None:
            raise ValueError(f"no {role} pool in this cluster (pools: {', '.join(self.specs)})")
        with self._lock:
            index = self._next_index[role]
            self._next_index[role] += 1
        name = actor_name(self.pools.cluster, role, index)
        deadline = time.monotonic() + timeout_s
        group = placement_group([spec.bundle()], strategy="PACK",
                                name=f"{NAME_PREFIX}:{self.pools.cluster}:{role}:{index}")
        handle = None
        try:
            ready, _ = ray.wait([group.ready()], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise ClusterStartError(f"cannot place one more {role} worker ({spec.bundle()}) within "
                                        f"{timeout_s:.0f}s")
            worker = WorkerSpec(role=role, worker_id=name, kv_backend=spec.kv_backend,
                                cluster_token=spec.cluster_token, moves_kv=spec.moves_kv,
                                tensor_parallel_size=spec.tensor_parallel_size)
            options, args = ray_actor(
                worker, spec.engine, namespace=self.pools.namespace, num_cpus=spec.num_cpus, num_gpus=spec.num_gpus,
                resources=spec.resources, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=0))
            handle = ray.remote(WorkerActor).options(**options).remote(*args)
            if standby:  # before anyone else's info() can see it serve (the actor runs a caller's calls in order)
                handle.set_standby.remote(True)
            try:
                health = ray.get(handle.health.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except Exception as exc:
                raise ClusterStartError(f"worker {name} failed to start: {short_error(exc)}") from None
            if not health.get("healthy"):
                raise ClusterStartError(f"worker {name} is unhealthy: {health.get('detail')}")
        except BaseException:
            if handle is not None:
                _kill(handle, name)
            remove_placement_group(group)
            raise
        self.pools.adopt(name, role, handle, group)  # shutdown removes it unless `remove` does first
        logger.info("started worker %s at %s", name, health.get("address"))
        return name

    def drain(self, name: str) -> None:
        self.directory.drain(name)

    def shift(self, name: str, duty: str) -> None:
        """The router counts and places the mixed worker `name` as `duty` (prefill, decode or mixed)."""
        worker = next((w for w in self.pools.workers if w.name == name), None)
        if worker is None:
            raise ValueError(f"no worker {name} in the pools")
        spec = self.specs.get(worker.role)
        if worker.role != "mixed" or spec is None or not spec.moves_kv:
            raise ValueError(f"{name} is not a hybrid worker (a mixed worker that moves KV): it cannot shift duty")
        self.directory.set_duty(name, duty)
        logger.info("worker %s now has %s duty", name, duty)

    def undrain(self, name: str) -> None:
        self.directory.draining.discard(name)

    def remove(self, name: str, grace_s: float = 2.0) -> None:
        """Forgets, stops and kills a drained worker (or a spare); releases its placement group
        when no other worker is in it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            for names in self._spares.values():
                if name in names:
                    names.remove(name)
        self.directory.remove_worker(name)
        worker, group = self.pools.release(name)
        release = group is not None
        try:
            ray.wait([worker.handle.stop.remote(grace_s / 2)], timeout=grace_s)
        except Exception:
            logger.debug("stopping %s failed", name, exc_info=True)
        _kill(worker.handle, name)
        if release:
            try:
                remove_placement_group(group)
            except Exception:
                logger.debug("removing the placement group of %s failed", name, exc_info=True)
        logger.info("removed worker %s%s", name, "" if release else " (its bundle stays with its pool's group)")


def _kill(handle: Any, name: str) -> None:
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception:
        logger.debug("killing %s failed", name, exc_info=True)
