"""`RayDirectory`: the router's view of the named worker actors (`pdserve.router.cluster.directory.WorkerDirectory`).

Each refresh resolves the actors by name and asks each for `info()` with a bounded timeout.
An actor that is dead, restarting or slow is left out of that answer (the router routes
around it) and is asked again on the next refresh; once Ray has restarted it, it answers with
its new address. At most one query per actor is in flight, so a hung actor never piles up
calls. Answers are cached for `refresh_interval_s`; concurrent callers share one refresh.

Resizing (`pdserve.launcher.cluster.resize`): `add_worker(name)` follows one more actor; `drain(name)`
puts it in `draining`, which the router's worker pool reads to keep placement off it while its
requests finish; `remove_worker(name)` forgets it (the router then drops it). A worker that says
it is a warm spare (`info()["standby"]`) is left out until it is promoted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from pdserve.router.cluster.directory import WorkerEndpoint
from pdserve.router.placement.base import ROLES

from pdserve.launcher.cluster.pools import parse_actor_name

logger = logging.getLogger(__name__)


class RayDirectory:
    """`names`: the actor names to follow; None discovers `pdserve:<cluster>:*` actors in the
    namespace on each refresh (e.g. a router started apart from `pdserve up`)."""

    def __init__(self, namespace: str, cluster: str = "default", names: Sequence[str] | None = None, *,
                 probe_timeout_s: float = 1.0, refresh_interval_s: float = 1.0) -> None:
        if probe_timeout_s <= 0:
            raise ValueError(f"probe_timeout_s must be > 0, got {probe_timeout_s}")
        self.namespace = namespace
        self.cluster = cluster
        self._names = list(names) if names is not None else None
        self.probe_timeout_s = probe_timeout_s
        self.refresh_interval_s = refresh_interval_s
        self._handles: dict[str, Any] = {}
        self._inflight: dict[str, asyncio.Future] = {}
        self._cache: list[WorkerEndpoint] | None = None
        self._cache_time = 0.0
        self._lock: asyncio.Lock | None = None
        self.last_info: dict[str, dict[str, Any]] = {}  # name -> last info() answer
        self.draining: set[str] = set()  # worker ids placement must skip (router.cluster.worker_pool)
        # mixed worker id -> the role the router counts it in (router.cluster.directory)
        self.duties: dict[str, str] = {}

    def add_worker(self, name: str) -> None:
        """Follow the actor `name` from the next refresh on (a fixed list only; discovery finds it)."""
        if self._names is not None and name not in self._names:
            self._names.append(name)
        self._cache = None

    def drain(self, name: str) -> None:
        """New requests go elsewhere; the worker's own requests run to their end."""
        self.draining.add(name)

    def set_duty(self, name: str, duty: str) -> None:
        """The router counts and places the mixed worker `name` as `duty` (prefill, decode, or
        mixed: its own role again) from its next refresh on. The caller knows the worker is mixed
        (the router's pool ignores, with a warning, a duty given to another role)."""
        if duty not in ROLES:
            raise ValueError(f"duty must be one of {ROLES}, got {duty!r}")
        if duty == "mixed":
            self.duties.pop(name, None)
        else:
            self.duties[name] = duty

    def remove_worker(self, name: str) -> None:
        """Forget the actor `name` (drained, or about to be killed)."""
        if self._names is not None and name in self._names:
            self._names.remove(name)
        # it stays in `draining`: the router's pool must not place on it until it drops it
        self._handles.pop(name, None)
        self.duties.pop(name, None)
        self.last_info.pop(name, None)
        self._cache = None

    async def endpoints(self) -> list[WorkerEndpoint]:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            now = time.monotonic()
            if self._cache is None or now - self._cache_time >= self.refresh_interval_s:
                self._cache = await self.refresh()
                self._cache_time = time.monotonic()
            return list(self._cache)

    async def refresh(self) -> list[WorkerEndpoint]:
        """Asks every actor now, ignoring the cache."""
        names = (self._names if self._names is not None
                 else await asyncio.wait_for(asyncio.to_thread(self._discover), self.probe_timeout_s * 5))
        answers = await asyncio.gather(*(self._probe(name) for name in names))
        endpoints = []
        for name, info in zip(names, answers):
            if info is None or info.get("standby"):  # a warm spare serves once it is promoted
                continue
            self.last_info[name] = info
            endpoints.append(WorkerEndpoint(worker_id=info["worker_id"], role=info["role"],
                                            address=info["address"], node=info.get("node_id", "")))
        return endpoints

    def _discover(self) -> list[str]:
        import ray

        names = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            parsed = parse_actor_name(entry["name"])
            if entry["namespace"] == self.namespace and parsed is not None and parsed[0] == self.cluster:
                names.append(entry["name"])
        return sorted(names)

    async def _probe(self, name: str) -> dict[str, Any] | None:
        """The actor's info(), or None when it cannot answer within probe_timeout_s (overall)."""
        deadline = time.monotonic() + self.probe_timeout_s
        future = self._inflight.get(name)
        if future is None or future.done():
            try:
                handle = await self._handle(name, self.probe_timeout_s)
            except Exception as exc:
                logger.debug("worker %s: no actor handle (%s)", name, exc)
                return None
            future = asyncio.wrap_future(handle.info.remote().future())
            future.add_done_callback(_retrieve)  # an answer nobody awaits any more is not an error
            self._inflight[name] = future
        try:
            info = await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            logger.info("worker %s did not answer within %.1fs; leaving it out", name, self.probe_timeout_s)
            return None
        except Exception as exc:  # ActorUnavailableError while restarting, ActorDiedError once dead
            logger.info("worker %s unavailable: %s", name, type(exc).__name__)
            if _is_dead_for_good(exc):
                self._handles.pop(name, None)
            return None
        finally:
            if future.done():
                self._inflight.pop(name, None)
        return info

    async def _handle(self, name: str, timeout_s: float) -> Any:
        handle = self._handles.get(name)
        if handle is None:
            import ray

            handle = await asyncio.wait_for(asyncio.to_thread(ray.get_actor, name, namespace=self.namespace),
                                            timeout_s)
            self._handles[name] = handle
        return handle


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _is_dead_for_good(exc: BaseException) -> bool:
    try:
        from ray.exceptions import ActorDiedError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, ActorDiedError)
