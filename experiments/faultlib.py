"""Shared pieces of the fault runs (faults.py, ride_through.py, plan_vs_real.py): a real `pdserve up` in its
own process group, the worker processes behind the router's /health, a /health timeline.

Not a test helper: everything here drives real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent


def cluster_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", **extra)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def start_up(args: list[str], log_path: Path, **env: str) -> subprocess.Popen:
    """`pdserve up <args>` in a new session (its own process group), output to log_path; `env`:
    variables for it beyond `cluster_env`'s."""
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "pdserve.launcher.cli", "up", *args], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env=cluster_env(**env), start_new_session=True)


def health(base: str, timeout_s: float = 3.0) -> dict | None:
    try:
        r = httpx.get(f"{base}/health", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    try:
        return r.json() | {"_status": r.status_code}
    except ValueError:
        return None


def wait_all_healthy(base: str, proc: subprocess.Popen | None, timeout_s: float, num_workers: int) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the cluster exited with {proc.returncode} while starting")
        h = health(base)
        if h and h["_status"] == 200:
            workers = h["backend"]["workers"]
            if len(workers) == num_workers and all(w["healthy"] for w in workers.values()):
                return h
        time.sleep(0.5)
    raise RuntimeError(f"{base}: {num_workers} healthy workers not reached within {timeout_s:.0f}s")


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


def stop_group(proc: subprocess.Popen, timeout_s: float = 20.0) -> float:
    """SIGTERM to the process group; seconds until the leader exited (SIGKILL past timeout_s)."""
    t0 = time.monotonic()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return time.monotonic() - t0
