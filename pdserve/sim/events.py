"""The simulated clock: a heap of (time, late, sequence number, callback, argument).

The sequence number breaks ties in scheduling order, so runs are deterministic. `late`
events run after every other event of the same instant (a worker's "start a step" waits
until all requests arriving at that instant are queued). Callbacks
that may be superseded (a step end that a slower host pushes back, a link completion that a
new flow moves) carry a version token and return early when it is stale.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable


class EventLoop:
    __slots__ = ("now", "_heap", "_seq", "num_events")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, bool, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self.num_events = 0

    def at(self, time: float, callback: Callable[[Any], None], arg: Any = None, *, late: bool = False) -> None:
        """Runs `callback(arg)` at `time` (never before now)."""
        if time < self.now:
            time = self.now
        self._seq += 1
        heapq.heappush(self._heap, (time, late, self._seq, callback, arg))

    def after(self, delay: float, callback: Callable[[Any], None], arg: Any = None) -> None:
        self.at(self.now + delay, callback, arg)

    def run(self, until: float = math.inf, max_events: int | None = None) -> None:
        """Processes events in time order until none is left, `until` is passed or
        `max_events` have run."""
        heap = self._heap
        pop = heapq.heappop
        budget = max_events if max_events is not None else -1
        while heap and heap[0][0] <= until and budget != 0:
            time, _, _, callback, arg = pop(heap)
            self.now = time
            self.num_events += 1
            budget -= 1
            callback(arg)

    def __len__(self) -> int:
        return len(self._heap)
