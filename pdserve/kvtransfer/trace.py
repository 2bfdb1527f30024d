"""Time points of every KV message on its way, for finding where a transfer's time goes.

Off unless switched on (``configure``, by ``kvtransfer.settings.configure``: a worker's
``WorkerConfig.kv_settings.trace``, which ``PDSERVE_KV_TRACE=1`` sets at the worker's start, or a
benchmark's own): then each ``mark`` appends ``(point, transfer key, first layer,
time.monotonic())`` to a bounded buffer (the newest 65,536 points), and ``drain`` hands them
over. ``time.monotonic`` is one clock for every process of a host, so a sender's points and its
receiver's line up (``benchmarks/bench_kvtransfer.py`` prints the timeline). Off, a mark is one
global check.

A served worker has nobody to drain it: given a dump directory as well (``PDSERVE_KV_TRACE_DIR=DIR``),
a thread of the process appends its points every half second to ``DIR/kv-trace-<pid>.jsonl``,
one JSON array ``[point, key, layer, t]`` a line (``write_points`` is that file's writer).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time

ENABLED = False  # `configure`
DUMP_DIR: str | None = None

_points: collections.deque = collections.deque(maxlen=1 << 16)
_lock = threading.Lock()
_dumping: set[str] = set()  # the directories a dump thread of this process writes to


def configure(enabled: bool, dump_dir: str | None = None) -> None:
    """Switches the marks on or off; on, with `dump_dir`, a daemon thread appends the points to
    `dump_dir/kv-trace-<pid>.jsonl` every half second (one thread per directory, however often
    this is called)."""
    global ENABLED, DUMP_DIR
    ENABLED, DUMP_DIR = bool(enabled), dump_dir or None
    if ENABLED and DUMP_DIR and DUMP_DIR not in _dumping:
        _dumping.add(DUMP_DIR)
        threading.Thread(target=_dump_forever, args=(DUMP_DIR,), daemon=True, name="kv-trace-dump").start()


def mark(point: str, key: int, layer: int = -1) -> None:
    if ENABLED:
        _points.append((point, key, layer, time.monotonic()))


def mark_at(point: str, key: int, layer: int, t: float) -> None:
    """A point at ``t`` (``time.monotonic``) worked out after the fact (a GPU timer's end)."""
    if ENABLED:
        _points.append((point, key, layer, t))


_local = threading.local()  # each thread's GPU timers stopped and not yet marked


def _pending() -> list:
    if not hasattr(_local, "pending"):
        _local.pending = []
    return _local.pending


def gpu_timer(device):
    """Start a timer of the GPU work queued next on ``device``'s current stream (None when off or
    not CUDA); ``gpu_timer_stop`` ends it, and ``flush_gpu_timers``, once the stream is waited
    for, marks the point at the host time of the start plus the GPU's elapsed time."""
    if not ENABLED or getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    start = torch.cuda.Event(enable_timing=True)
    start.record()
    return start, time.monotonic()


def gpu_timer_stop(timer, point: str, key: int, layer: int = -1) -> None:
    if timer is None:
        return
    import torch

    end = torch.cuda.Event(enable_timing=True)
    end.record()
    _pending().append((timer, end, point, key, layer))


def flush_gpu_timers() -> None:
    """Mark every stopped GPU timer (call after waiting for their streams)."""
    pending = _pending() if ENABLED else ()
    while pending:
        (start, host_start), end, point, key, layer = pending.pop(0)
        end.synchronize()
        mark_at(point, key, layer, host_start + start.elapsed_time(end) / 1e3)


def drain() -> list[tuple[str, int, int, float]]:
    """The points marked so far, oldest first; the buffer is emptied."""
    with _lock:
        out = list(_points)
        _points.clear()
    return out


def write_points(points: list, path: str) -> None:
    """Append ``points`` (``drain``'s) to ``path``, one JSON array a line."""
    if points:
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(list(p)) + "\n" for p in points)


def _dump_forever(directory: str, every_s: float = 0.5) -> None:
    path = os.path.join(directory, f"kv-trace-{os.getpid()}.jsonl")
    while True:
        time.sleep(every_s)
        try:
            write_points(drain(), path)
        except OSError as e:  # a full or vanished directory ends the dump, not the worker
            logging.getLogger(__name__).warning("PDSERVE_KV_TRACE_DIR: cannot write %s (%s); KV trace dump stopped",
                                                path, e)
            return

