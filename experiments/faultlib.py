"""Shared pieces of the fault runs (faults.py, ride_through.py, plan_vs_real.py): a real `pdserve up`
(loadgen's ServerProcess: its own process group, always stopped), the worker processes behind the
router's /health, a /health timeline.

Not a test helper: everything here drives real processes."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from pdserve.loadgen.launcher import ServerProcess, answers_200

REPO = Path(__file__).resolve().parent.parent


def cluster_env(**extra: str) -> dict[str, str | None]:
    """What every process of a fault run gets on top of this process's environment (ServerProcess's
    `env`: None removes a variable): no Ray usage stats, unbuffered output, Ray's auth off unless
    set, no RAY_ADDRESS (a cluster of its own), this checkout first on PYTHONPATH; then `extra`."""
    env: dict[str, str | None] = {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", **extra}
    env.setdefault("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE", "disabled"))
    env["RAY_ADDRESS"] = None
    pythonpath = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + pythonpath if pythonpath else "")
    return env


def all_healthy(num_workers: int) -> Callable[[httpx.Response], bool]:
    """A readiness test for ServerProcess: the router's /health answers 200 with `num_workers`
    workers, every one healthy."""
    def ready(response: httpx.Response) -> bool:
        if response.status_code != 200:
            return False
        try:
            workers = response.json()["backend"]["workers"]
        except (ValueError, KeyError, TypeError):
            return False
        return len(workers) == num_workers and all(w["healthy"] for w in workers.values())

    return ready


def up_process(args: list[str], base: str, log_path: str | Path, *, num_workers: int | None = None,
               env: dict[str, str] | None = None, **options) -> ServerProcess:
    """`pdserve up <args>` as a fault run starts it (from this checkout, `cluster_env(**env)`), not
    started yet: ready once the router at `base` answers /health with 200 and, with `num_workers`,
    that many healthy workers. `options`: more ServerProcess settings (timeouts, poll interval)."""
    options = {"poll_interval_s": 0.5, **options}
    return ServerProcess([sys.executable, "-m", "pdserve.launcher.cli", "up", *args], health_url=f"{base}/health",
                         log_path=log_path, env=cluster_env(**(env or {})), cwd=REPO, name="pdserve up",
                         ready=answers_200 if num_workers is None else all_healthy(num_workers), **options)


def health(base: str, timeout_s: float = 3.0) -> dict | None:
    try:
        r = httpx.get(f"{base}/health", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    try:
        return r.json() | {"_status": r.status_code}
    except ValueError:
        return None


def listener_pid(address: str) -> int | None:
    """The pid of the process listening on host:port (a worker's gRPC address)."""
    host, _, port = address.rpartition(":")
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == int(port) and c.pid:
            return c.pid
    return None


def worker_pid(base: str, role: str) -> tuple[str, int]:
    """(worker id, pid) of the first worker of `role` behind the router at `base`."""
    h = health(base)
    if not h:
        raise RuntimeError(f"{base}/health does not answer")
    for wid, w in sorted(h["backend"]["workers"].items()):
        if w["role"] == role:
            pid = listener_pid(w["address"])
            if pid is None:
                raise RuntimeError(f"no process listens on {w['address']} ({wid})")
            return wid, pid
    raise RuntimeError(f"no {role} worker in {sorted(h['backend']['workers'])}")


class HealthTimeline(threading.Thread):
    """Polls /health every `interval_s`: (unix time, {worker id: (healthy, address)}) samples."""

    def __init__(self, base: str, interval_s: float = 0.25) -> None:
        super().__init__(name="health-timeline", daemon=True)
        self.base = base
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, tuple[bool, str]]]] = []
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self.interval_s):
            h = health(self.base, timeout_s=1.0)
            workers = (h or {}).get("backend", {}).get("workers", {})
            self.samples.append((time.time(), {k: (w["healthy"], w["address"]) for k, w in workers.items()}))

    def stop(self) -> None:
        self._stop.set()

    def back_at(self, worker_id: str, after: float, old_address: str | None = None) -> float | None:
        """First time after `after` when `worker_id` is healthy again (at a new address, when given)."""
        down_seen = False
        for t, workers in self.samples:
            if t < after:
                continue
            healthy, address = workers.get(worker_id, (False, ""))
            if not healthy or (old_address is not None and address == old_address):
                down_seen = True
                continue
            if down_seen or old_address is not None:
                return t
        return None
