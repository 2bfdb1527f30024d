"""The planner loop: an asyncio task in the `pdserve up` process, on the router's event loop.

Why there and not in a process of its own: the signals it needs are the router's own (its
window of requests, its worker pool with each worker's polled stats and the router's in-flight
counts), read directly rather than scraped and parsed; the drain needs the router's in-flight
count of the worker, which only the router knows exactly; and it shares the router's fate (one
Ctrl-C stops both, no orphan resizing a cluster whose router is gone). The Ray calls that
block (placing and starting a worker, killing one) run in threads (`asyncio.to_thread`), so
the router keeps serving meanwhile.

Every `interval_s`: read a `ClusterState` (`observe`), ask the rule (`pdserve.launcher.autoscale.rule`),
count the decision, and start the change it asks for as a task of its own: add (start a worker,
wait until the router sees it healthy) or remove (pick the pool's least loaded worker, its own
placement group first; drain it, wait until it is empty for three polls in a row, then remove
it), or shift (a hybrid worker's duty: the directory's role override, router.cluster.directory;
no process starts or stops, so it ends at once). One change at a time; the rule's cooldown counts
from the end of the last one.

Warm spares (`AutoscaleConfig.spares`, per pool): the loop starts them when it starts and after
each addition that took one (a task beside the changes, not one of them: the cooldown does not
wait for it), up to the pool's maximum with the serving workers; an addition takes a spare when
the pool has one (it serves about a second later instead of after a model load and a warm-up),
and a drained worker is parked as a spare instead of removed while its pool has fewer than it
wants.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pdserve.launcher.autoscale.metrics import AutoscaleMetrics
from pdserve.launcher.autoscale.rule import (AUTO, DUTIES, AutoscaleConfig, ClusterState, Decision, PoolState,
                                             RuleMemory, auto_up_load, decide)
from pdserve.launcher.autoscale.window import RequestWindow

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.5
SPARE_START_TIMEOUT_S = 300.0  # a spare that cannot be placed or started by then is given up (until the next addition)
EMPTY_POLLS = 3  # consecutive empty observations before a drained worker leaves


class Autoscaler:
    """`backend`: the router's `ClusterBackend` (its `pool.workers`); `resizer`: a
    `pdserve.launcher.cluster.resize.PoolResizer` (or a fake with `specs`, `add`, `drain`, `undrain`,
    `remove`, `own_group`, `shift` for hybrid pools, and `spares`, `prepare_spare`, `park` for warm spares); \
`max_num_seqs`: the workers' batch limit (a full decode batch)."""

    def __init__(self, config: AutoscaleConfig, backend: Any, window: RequestWindow, resizer: Any, *,
                 max_num_seqs: int, metrics: AutoscaleMetrics | None = None,
                 on_change: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_num_seqs = max(1, max_num_seqs)
        self.config, _ = resolve_up_load(config, max_num_seqs=self.max_num_seqs, slo_tpot=None)  # "auto" made a number
        self.backend = backend
        self.window = window
        self.resizer = resizer
        self.metrics = metrics
        self.on_change = on_change
        self.clock = clock
        self.roles = tuple(resizer.specs)
        # mixed workers that also move KV (--mode hybrid) can shift duty between prefill and decode
        self.hybrid = bool(getattr(resizer.specs.get("mixed"), "moves_kv", False))
        self.memory = RuleMemory()
        self.last_change_end = -float("inf")
        # (time, {pool: fraction of its workers busy}, {pool: requests in flight per worker})
        self._busy: deque[tuple[float, dict[str, float], dict[str, float]]] = deque()
        self._change: asyncio.Task[None] | None = None
        self._spares_task: asyncio.Task[None] | None = None
        self.decisions: list[tuple[float, Decision]] = []

    # ---------------------------------------------------------------- reading the router

    def _pool_workers(self, role: str) -> list[Any]:
        return [w for w in self.backend.pool.workers.values() if w.endpoint.role == role]

    def observe(self) -> ClusterState:
        now = self.clock()
        since = max(now - self.config.window_s, self.last_change_end)
        pools: dict[str, PoolState] = {}
        busy_now: dict[str, float] = {}
        load_now: dict[str, float] = {}
        for role in self.roles:
            workers = self._pool_workers(role)
            serving = [w for w in workers if not w.draining]
            waiting = running = 0.0
            full = 0.0
            busy = 0
            inflight = 0
            for w in serving:
                s = w.stats
                if s is not None:
                    waiting += s.num_waiting + s.num_awaiting_kv
                    running += s.num_running
                    usage = 1.0 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0
                    full = max(full, s.num_running / self.max_num_seqs, usage)
                # the router's count (from its decision on: queued, reserved, running) or the worker's
                load = max(w.num_inflight, s.num_waiting + s.num_running + s.num_held if s is not None else 0)
                inflight += load
                if load > 0:
                    busy += 1
            busy_now[role] = busy / len(serving) if serving else 0.0
            load_now[role] = inflight / len(serving) if serving else 0.0
            pools[role] = PoolState(workers=len(serving), draining=len(workers) - len(serving), waiting=waiting,
                                    running=running, batch_full=full)
        self._busy.append((now, busy_now, load_now))
        while self._busy and self._busy[0][0] < since:
            self._busy.popleft()
        samples = [(b, n) for t, b, n in self._busy if t >= since]
        pools = {role: replace(p, busy=sum(b.get(role, 0.0) for b, _ in samples) / len(samples),
                               load=sum(n.get(role, 0.0) for _, n in samples) / len(samples))
                 for role, p in pools.items()}
        att = self.window.attainment(since)
        duties: dict[str, int] = {}
        if self.hybrid:
            for w in self._pool_workers("mixed"):
                if not w.draining:
                    duties[w.role] = duties.get(w.role, 0) + 1
        return ClusterState(now=now, pools=pools, finished=att.finished, attainment=att.attainment,
                            ttft_attainment=att.ttft, tpot_attainment=att.tpot,
                            arrival_rate=self.window.arrival_rate(now - self.config.window_s),
                            changing=self._change is not None and not self._change.done(), duties=duties)

    # ---------------------------------------------------------------- deciding and acting

    async def run(self) -> None:
        self.replenish_spares()
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.step()
            except Exception:
                logger.exception("autoscaler step failed")

    async def step(self) -> Decision:
        state = self.observe()
        decision, self.memory = decide(state, self.config, self.memory)
        self.decisions.append((state.now, decision))
        self._record(state, decision)
        if decision.action == "add":
            self._change = asyncio.create_task(self._add(decision), name="autoscale-add")
        elif decision.action == "remove":
            self._change = asyncio.create_task(self._remove(decision), name="autoscale-remove")
        elif decision.action == "shift":
            self._shift(decision)
        return decision

    async def wait_change(self) -> None:
        if self._change is not None:
            await self._change

    async def close(self) -> None:
        for task in (self._change, self._spares_task):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except Exception:  # a change that failed as it was cancelled: shutting down anyway
                    logger.debug("autoscale task failed while closing", exc_info=True)

    # ---------------------------------------------------------------- warm spares

    def _spares(self, role: str) -> list[str]:
        spares = getattr(self.resizer, "spares", None)
        return spares(role) if spares is not None else []

    def spares_wanted(self, role: str) -> int:
        """How many more spares `role` should have: its `spares` setting less those it has, and
        no more than its maximum leaves room for beside the serving (and draining) workers."""
        want = self.config.spares.get(role, 0)
        if want <= 0:
            return 0
        have = len(self._spares(role))
        room = self.config.max_workers.get(role, 0) - len(self._pool_workers(role)) - have
        return max(0, min(want - have, room))

    def replenish_spares(self) -> None:
        """Starts the spares the pools lack, one at a time, in a task of its own (unless one runs)."""
        if not any(self.config.spares.get(role, 0) > 0 for role in self.roles):
            return
        if self._spares_task is None or self._spares_task.done():
            self._spares_task = asyncio.create_task(self._replenish(), name="autoscale-spares")

    async def _replenish(self) -> None:
        for role in self.roles:
            while self.spares_wanted(role) > 0:
                start = self.clock()
                try:
                    name = await asyncio.to_thread(self.resizer.prepare_spare, role, SPARE_START_TIMEOUT_S)
                except Exception as exc:  # no room, or it failed: tried again after the next addition
                    logger.warning("autoscale: starting a warm spare of the %s pool failed: %s", role, exc)
                    break
                self._spares_changed()
                if self.on_change is not None:
                    self.on_change(f"{name} is a warm spare of the {role} pool (ready in {self.clock() - start:.1f}s)")

    def _spares_changed(self) -> None:
        if self.metrics is not None:
            for role in self.roles:
                self.metrics.pool_workers.labels(role, "spare").set(len(self._spares(role)))

    def _record(self, state: ClusterState, decision: Decision) -> None:
        if decision.action == "shift":
            logger.warning("autoscale: shift a hybrid worker %s -> %s: %s", decision.source, decision.pool,
                           decision.reason)
            if self.on_change is not None:
                self.on_change(f"shift a hybrid worker from {decision.source} to {decision.pool} duty: "
                               f"{decision.reason}")
        elif decision.action != "hold":
            logger.warning("autoscale: %s %s: %s", decision.action, decision.pool, decision.reason)
            if self.on_change is not None:
                self.on_change(f"{decision.action} a {decision.pool} worker: {decision.reason}")
        else:
            logger.info("autoscale: hold (%s)", decision.reason)
        if self.metrics is None:
            return
        self.metrics.decisions.labels(decision.action, decision.pool or "none", decision.code).inc()
        self.metrics.attainment.labels("both").set(state.attainment)
        self.metrics.attainment.labels("ttft").set(state.ttft_attainment)
        self.metrics.attainment.labels("tpot").set(state.tpot_attainment)
        self.metrics.arrival_rate.set(state.arrival_rate)
        for role, pool in state.pools.items():
            self.metrics.pool_workers.labels(role, "serving").set(pool.workers)
            self.metrics.pool_workers.labels(role, "draining").set(pool.draining)
            self.metrics.pool_busy.labels(role).set(pool.busy)
            self.metrics.pool_load.labels(role).set(pool.load)
        for duty in DUTIES:
            self.metrics.duties.labels(duty).set(state.duties.get(duty, 0))

    def _ended(self, what: str) -> None:
        self.last_change_end = self.clock()
        self.memory = replace(self.memory, last_change_at=self.last_change_end)
        if self.on_change is not None:
            self.on_change(what)

    def pick_to_shift(self, duty: str) -> str | None:
        """The hybrid worker of `duty` to shift: the least loaded, then the newest."""
        candidates = [w for w in self._pool_workers("mixed") if not w.draining and w.role == duty]
        if not candidates:
            return None

        def key(w: Any) -> tuple:
            s = w.stats
            return (w.num_inflight + (s.num_waiting + s.num_running if s is not None else 0), _index_desc(w.worker_id))

        return min(candidates, key=key).worker_id

    def _shift(self, decision: Decision) -> None:
        """Gives a hybrid worker of duty `decision.source` the duty `decision.pool`: the directory
        holds it, the router's pool applies it now (its next sync reads the same). Its requests
        in flight run on; new ones are placed by its new duty."""
        assert decision.pool is not None and decision.source is not None
        name = self.pick_to_shift(decision.source)
        if name is None:
            self._ended(f"no hybrid worker of {decision.source} duty to shift")
            return
        self.resizer.shift(name, decision.pool)
        worker = self.backend.pool.workers.get(name)
        if worker is not None:
            worker.duty = None if decision.pool == worker.endpoint.role else decision.pool
        self._ended(f"{name} serves with {decision.pool} duty (was {decision.source})")

    async def _add(self, decision: Decision) -> None:
        assert decision.pool is not None
        start = self.clock()
        spare = bool(self._spares(decision.pool))
        try:
            name = await asyncio.to_thread(self.resizer.add, decision.pool)
        except Exception as exc:
            logger.warning("autoscale: adding a %s worker failed: %s", decision.pool, exc)
            self._ended(f"adding a {decision.pool} worker failed: {exc}")
            return
        finally:
            self._spares_changed()
        deadline = self.clock() + 60.0
        while self.clock() < deadline:  # until the router serves with it
            worker = self.backend.pool.workers.get(name)
            if worker is not None and worker.healthy and not getattr(worker, "warming", False):
                break  # placed from now on (a joiner's KV pairs are warmed first)
            await asyncio.sleep(DRAIN_POLL_S)
        self._ended(f"{name} serves ({'a warm spare, ' if spare else ''}"
                    f"{self.clock() - start:.1f}s after the decision)")
        self.replenish_spares()

    def pick_to_remove(self, role: str, duty: str | None = None) -> str | None:
        """The pool's worker to drain (of hybrid `duty` when given): one with its own placement
        group first, then the least loaded, then the newest."""
        candidates = [w for w in self._pool_workers(role) if not w.draining and (duty is None or w.role == duty)]
        if not candidates:
            return None

        def key(w: Any) -> tuple:
            s = w.stats
            load = w.num_inflight + (s.num_waiting + s.num_running + s.num_held if s is not None else 0)
            return (not self.resizer.own_group(w.worker_id), load, _index_desc(w.worker_id))

        return min(candidates, key=key).worker_id

    async def _remove(self, decision: Decision) -> None:
        assert decision.pool is not None
        name = self.pick_to_remove(decision.pool, decision.source)
        if name is None:
            self._ended(f"no {decision.pool} worker"
                        f"{f' of {decision.source} duty' if decision.source else ''} to remove")
            return
        await self.drain_and_remove(name)

    async def drain_and_remove(self, name: str) -> None:
        """Drains `name` (placement skips it), waits until it is empty for EMPTY_POLLS polls in
        a row, then removes it; undrains it instead when that takes over `drain_timeout_s`."""
        self.resizer.drain(name)
        worker = self.backend.pool.workers.get(name)
        if worker is not None:
            worker.draining = True  # at once; the pool's next sync reads the same from the directory
        start = self.clock()
        empty = 0
        while empty < EMPTY_POLLS:
            await asyncio.sleep(DRAIN_POLL_S)
            worker = self.backend.pool.workers.get(name)
            if worker is None:
                break
            empty = empty + 1 if worker.is_empty else 0
            if int(self.clock() - start) % 30 == 0 and not worker.is_empty:
                st = worker.stats
                logger.info("autoscale: %s drains: %d in flight, %s", name, worker.num_inflight,
                            "no stats" if st is None else f"{st.num_waiting} waiting, {st.num_running} running, "
                            f"{st.num_held} held, {st.num_awaiting_kv} awaiting KV")
            if self.clock() - start > self.config.drain_timeout_s:
                self.resizer.undrain(name)
                worker.draining = False
                logger.warning("autoscale: %s did not empty within %.0fs; it stays", name, self.config.drain_timeout_s)
                self._ended(f"{name} did not drain; it stays")
                return
        role = worker.endpoint.role if worker is not None else None
        if role is not None and self.config.spares.get(role, 0) > len(self._spares(role)):
            try:
                await asyncio.to_thread(self.resizer.park, name)
            except Exception as exc:
                logger.warning("autoscale: parking %s as a spare failed (%s); it is removed", name, exc)
            else:
                self._spares_changed()
                self._ended(f"{name} drained in {self.clock() - start:.1f}s and is a warm spare")
                return
        await asyncio.to_thread(self.resizer.remove, name)
        self._ended(f"{name} drained in {self.clock() - start:.1f}s and left")


def _index_desc(name: str) -> int:
    tail = name.rsplit(":", 1)[-1]
    return -int(tail) if tail.isdigit() else 0


def resolve_up_load(config: AutoscaleConfig, *, max_num_seqs: int, slo_tpot: float | None,
                    profile: Any = None) -> tuple[AutoscaleConfig, str | None]:
    """`up_load: auto` made a number (`rule.auto_up_load`) from the workers' batch cap and, when
    the cluster has one, the profile's decode steps at its longest profiled context; the config
    as given otherwise. Returns (config, the sentence saying how, or None)."""
    if config.up_load != AUTO:
        return config, None
    step = None
    if profile is not None:
        context = max(profile.decode_contexts)
        step = lambda batch: profile.decode_step_seconds(batch, context)  # noqa: E731
    value, why = auto_up_load(max_num_seqs, slo_tpot, step)
    return replace(config, up_load=value), why


def attach(config: AutoscaleConfig, pools: Any, directory: Any, *, slo_ttft: float | None, slo_tpot: float | None,
           max_num_seqs: int, on_change: Callable[[str], None] | None = None, profile: Any = None):
    """What `pdserve up --autoscale` hands the router: (wrap_backend, background) for
    `pdserve.launcher.cluster.serving.build_app` and `serve_router`. The wrapper records each request
    in the window and, once the app is built, makes the `Autoscaler` over the real backend;
    the background task runs its loop. `profile` (a `pdserve.router.placement.profiles.Profile`, or
    None) sizes `up_load: auto`."""
    from pdserve.launcher.cluster.resize import PoolResizer

    config, why = resolve_up_load(config, max_num_seqs=max_num_seqs, slo_tpot=slo_tpot, profile=profile)
    if why is not None:
        logger.info("autoscale: %s", why)
        if on_change is not None:
            on_change(why)

    window = RequestWindow(slo_ttft, slo_tpot, horizon_s=max(300.0, 2 * config.window_s))
    resizer = PoolResizer(pools, directory)
    made: dict[str, Autoscaler] = {}

    def wrap_backend(backend: Any, metrics: Any) -> Any:
        from pdserve.launcher.autoscale.window import ObservedBackend

        made["autoscaler"] = Autoscaler(config, backend, window, resizer, max_num_seqs=max_num_seqs,
                                        metrics=AutoscaleMetrics(metrics.registry, tuple(resizer.specs)),
                                        on_change=on_change)
        return ObservedBackend(backend, window)

    async def run() -> None:
        autoscaler = made["autoscaler"]
        try:
            await autoscaler.run()
        finally:
            await autoscaler.close()

    return wrap_backend, (run,)
