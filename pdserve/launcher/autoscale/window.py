"""The router's own signals over a sliding window: arrivals, and each request's TTFT and TPOT
against the SLOs.

`ObservedBackend` wraps the router's backend (what the HTTP app calls): every `generate` is an
arrival; one that ends is a finished request, with its TTFT (arrival at the backend to the
first token) and TPOT (mean time between the later tokens); one that raises (503, 429, a
worker error past its retries) is a failure, which misses the SLOs. A request the client
abandons counts for neither. Everything else is delegated to the wrapped backend.

A request still running counts as soon as it can no longer meet the SLO: no first token past
the TTFT SLO, a first token that came late, or a running TPOT over the SLO after
`LIVE_TPOT_TOKENS` tokens. Otherwise an overloaded cluster, whose requests take longer than
the window, would show no finished requests and so no misses.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any


LIVE_TPOT_TOKENS = 5


@dataclass
class Live:
    arrived: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0


@dataclass(frozen=True)
class Finished:
    at: float  # when it ended (monotonic)
    arrived: float  # when it arrived
    ttft_s: float | None  # None: it failed before a first token
    tpot_s: float | None  # None: one token, or failed
    failed: bool = False


@dataclass(frozen=True)
class Attainment:
    finished: int
    attainment: float  # both SLOs met (failures miss)
    ttft: float
    tpot: float


class RequestWindow:
    """Arrivals and finished requests, kept for `horizon_s`; SLOs None are not checked."""

    def __init__(self, slo_ttft: float | None, slo_tpot: float | None, horizon_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slo_ttft, self.slo_tpot = slo_ttft, slo_tpot
        self.horizon_s = horizon_s
        self.clock = clock
        self.arrivals: deque[float] = deque()
        self.finished: deque[Finished] = deque()
        self.failures = 0  # since the start
        self.live: dict[int, Live] = {}  # requests running now

    def arrive(self) -> None:
        self.arrivals.append(self.clock())
        self._trim()

    def finish(self, ttft_s: float | None, tpot_s: float | None, failed: bool = False,
               arrived: float | None = None) -> None:
        now = self.clock()
        self.finished.append(Finished(now, now if arrived is None else arrived, ttft_s, tpot_s, failed))
        self.failures += failed
        self._trim()

    def _trim(self) -> None:
        edge = self.clock() - self.horizon_s
        while self.arrivals and self.arrivals[0] < edge:
            self.arrivals.popleft()
        while self.finished and self.finished[0].at < edge:
            self.finished.popleft()

    def arrival_rate(self, since: float) -> float:
        now = self.clock()
        since = max(since, now - self.horizon_s)
        if now <= since:
            return 0.0
        return sum(1 for t in self.arrivals if t >= since) / (now - since)

    def attainment(self, since: float) -> Attainment:
        """Over the requests that arrived at or after `since` and have ended, or already missed
        while running (1.0 each when there are none): after a change, only requests that met the
        new pools count."""
        done = [f for f in self.finished if f.arrived >= since]
        now = self.clock()
        for live in self.live.values():
            if live.arrived < since:
                continue
            ttft = (live.first if live.first is not None else now) - live.arrived
            late = self.slo_ttft is not None and ttft > self.slo_ttft
            slow = (self.slo_tpot is not None and live.tokens >= LIVE_TPOT_TOKENS
                    and (live.last - live.first) / (live.tokens - 1) > self.slo_tpot)
            if late or slow:
                done.append(Finished(now, live.arrived, ttft if late else 0.0,
                                     (live.last - live.first) / (live.tokens - 1) if slow else None))
        if not done:
            return Attainment(0, 1.0, 1.0, 1.0)
        ttft_ok = [not f.failed and self._ttft_ok(f) for f in done]
        tpot_ok = [not f.failed and self._tpot_ok(f) for f in done]
        both = sum(a and b for a, b in zip(ttft_ok, tpot_ok))
        n = len(done)
        return Attainment(n, both / n, sum(ttft_ok) / n, sum(tpot_ok) / n)

    def _ttft_ok(self, f: Finished) -> bool:
        return self.slo_ttft is None or (f.ttft_s is not None and f.ttft_s <= self.slo_ttft)

    def _tpot_ok(self, f: Finished) -> bool:
        return self.slo_tpot is None or f.tpot_s is None or f.tpot_s <= self.slo_tpot


class ObservedBackend:
    """The router's backend, with each request recorded in `window` (module docstring)."""

    def __init__(self, backend: Any, window: RequestWindow) -> None:
        self._backend = backend
        self.window = window

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any) -> AsyncIterator[Any]:
        window = self.window
        clock = window.clock
        window.arrive()
        arrival = clock()
        first: float | None = None
        last: float | None = None
        tokens = 0
        ended = False
        live = Live(arrival)
        window.live[id(live)] = live
        try:
            async for output in self._backend.generate(request_id, prompt_token_ids, params):
                if output.new_token_ids:
                    last = clock()
                    if first is None:
                        first = last
                    tokens += len(output.new_token_ids)
                    live.first, live.last, live.tokens = first, last, tokens
                if output.finished:
                    window.live.pop(id(live), None)
                if output.finished and output.finish_reason != "abort":
                    ended = True
                    window.finish(first - arrival if first is not None else None,
                                  (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1
                                  else None, arrived=arrival)
                yield output
        except Exception:
            if not ended:
                window.finish(first - arrival if first is not None else None, None, failed=True, arrived=arrival)
                ended = True
            raise
        finally:
            window.live.pop(id(live), None)
