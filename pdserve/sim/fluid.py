"""A resource shared by flows: max-min fair shares with per-flow caps (water-filling).

A KV link is one (capacity in bytes/s; a flow is one request's KV, capped by the rate at which
its prefill produces KV while it computes, uncapped after). A host's CPU is another (capacity
in cores; a flow is one worker's step, capped at one core for a one-thread worker).

Between changes every rate is constant, so the resource keeps one pending completion event:
the earliest flow to finish. Any change (a flow added, removed, re-capped) first charges the
elapsed time to every flow, then recomputes the shares and re-arms that event.
"""

from __future__ import annotations

import math
from typing import Callable

from pdserve.sim.events import EventLoop

EPS = 1e-9


class Flow:
    """`work` units to move at most at `cap` per second; `on_done(flow)` when the last unit is moved."""

    __slots__ = ("work", "cap", "rate", "on_done", "owner", "started", "resource")

    def __init__(self, work: float, on_done: Callable[["Flow"], None], *, cap: float = math.inf,
                 owner: object = None) -> None:
        self.work = float(work)
        self.cap = cap
        self.rate = 0.0
        self.on_done = on_done
        self.owner = owner
        self.started = 0.0
        self.resource: FluidResource | None = None


class FluidResource:
    __slots__ = ("loop", "capacity", "flows", "_last", "_version", "name", "peak_flows")

    def __init__(self, loop: EventLoop, capacity: float, name: str = "") -> None:
        if not capacity > 0:
            raise ValueError(f"{name or 'resource'}: capacity must be > 0, got {capacity!r}")
        self.loop = loop
        self.capacity = float(capacity)
        self.flows: list[Flow] = []
        self._last = 0.0
        self._version = 0
        self.name = name
        self.peak_flows = 0

    # ---------------------------------------------------------------- changes

    def add(self, flow: Flow) -> None:
        self._charge()
        flow.started = self.loop.now
        flow.resource = self
        self.flows.append(flow)
        self.peak_flows = max(self.peak_flows, len(self.flows))
        self._rearm()

    def set_cap(self, flow: Flow, cap: float) -> None:
        if flow.resource is not self:
            flow.cap = cap
            return
        self._charge()
        flow.cap = cap
        self._rearm()

    def remove(self, flow: Flow) -> None:
        """Takes `flow` off without completing it (aborted)."""
        if flow.resource is not self:
            return
        self._charge()
        self.flows.remove(flow)
        flow.resource = None
        self._rearm()

    # ---------------------------------------------------------------- internals

    def _charge(self) -> None:
        now = self.loop.now
        elapsed = now - self._last
        if elapsed > 0:
            for f in self.flows:
                f.work -= f.rate * elapsed
        self._last = now

    def _shares(self) -> None:
        flows = sorted(self.flows, key=_cap)
        left = self.capacity
        n = len(flows)
        for f in flows:
            share = left / n
            rate = f.cap if f.cap < share else share
            f.rate = rate
            left -= rate
            n -= 1

    def _rearm(self) -> None:
        self._version += 1
        if not self.flows:
            return
        self._shares()
        soonest = math.inf
        for f in self.flows:
            if f.rate > 0:
                t = max(f.work, 0.0) / f.rate
                if t < soonest:
                    soonest = t
        if soonest < math.inf:
            self.loop.after(soonest, self._fire, self._version)

    def _fire(self, version: int) -> None:
        if version != self._version:
            return
        self._charge()
        done = [f for f in self.flows if f.work <= EPS * max(1.0, f.rate)]
        if not done:  # rounding: the soonest flow is a hair short
            done = [min(self.flows, key=lambda f: f.work / f.rate if f.rate > 0 else math.inf)]
        for f in done:
            self.flows.remove(f)
            f.work = 0.0
            f.resource = None
        self._rearm()
        for f in done:
            f.on_done(f)


def _cap(flow: Flow) -> float:
    return flow.cap
