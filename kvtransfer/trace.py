"""Time points of every KV message on its way, for finding where a transfer's time goes.

Off unless ``PDSERVE_KV_TRACE=1`` in the process's environment when this module is imported:
then each ``mark`` appends ``(point, transfer key, first layer, time.monotonic())`` to a bounded
buffer (the newest 65,536 points), and ``drain`` hands them over. ``time.monotonic`` is one clock
for every process of a host, so a sender's points and its receiver's line up
(``benchmarks/bench_kvtransfer.py`` prints the timeline). Off, a mark is one global check.
"""

from __future__ import annotations

import collections
import os
import threading
import time

ENABLED = os.environ.get("PDSERVE_KV_TRACE") == "1"

_points: collections.deque = collections.deque(maxlen=1 << 16)
_lock = threading.Lock()


def mark(point: str, key: int, layer: int = -1) -> None:
    if ENABLED:
        _points.append((point, key, layer, time.monotonic()))


def drain() -> list[tuple[str, int, int, float]]:
    """The points marked so far, oldest first; the buffer is emptied."""
    with _lock:
        out = list(_points)
        _points.clear()
    return out
