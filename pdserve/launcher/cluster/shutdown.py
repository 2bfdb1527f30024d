"""Bounded shutdown of everything `pdserve up` started, whatever killed it.

`kill -TERM -- -PGID` (timeout, shells, supervisors) signals Ray's own daemons too: the GCS
stops serving at once (and does not exit while the driver lives), the raylet waits for it, and
every Ray call the driver then makes that needs the GCS (kill an actor, remove a placement
group, `ray.shutdown`) waits until the GCS comes back. So shutdown never trusts Ray:

1. `ProcessTracker` records, every second, the processes below this one (GCS, raylet, the
   worker actors that the raylet spawned in their own process groups). A process reparented
   away when its raylet died is still in the record. `end_all` ends them the way
   `ray.shutdown` ends Ray's processes (SIGTERM, a grace, SIGKILL), with no call to Ray.
2. `RayWatchdog` notices Ray dying under the driver (a local GCS or raylet gone, or the GCS
   port of a joined cluster unreachable for a few seconds) and raises SIGTERM in the driver,
   so that the same shutdown path runs; once a stop was asked for it stays quiet (a signal to
   the process group takes Ray's daemons down with the rest, as it should).
3. `run_bounded(fn, timeout_s)` runs each Ray cleanup step in a daemon thread and gives up
   on it at its deadline; what is left is SIGKILLed from the record (`kill_leftovers`).
4. `HardDeadline`: if the whole shutdown is not over by its deadline, the leftovers are
   killed and the process exits.

Worker actors also watch their raylet (`pdserve.launcher.cluster.ray_workers`), so a worker on another
node ends when its node's raylet dies.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import psutil

logger = logging.getLogger(__name__)

RAY_DAEMONS = ("gcs_server", "raylet")


class ProcessTracker:
    """Every process below `root_pid` seen so far, as pid -> (create time, name)."""

    def __init__(self, root_pid: int | None = None, interval_s: float = 1.0) -> None:
        self.root_pid = root_pid or os.getpid()
        self.interval_s = interval_s
        self.seen: dict[int, tuple[float, str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scan(self) -> None:
        try:
            children = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.Error:
            return
        found = {}
        for p in children:
            try:
                found[p.pid] = (p.create_time(), p.name())
            except psutil.Error:
                continue
        with self._lock:
            self.seen.update(found)

    def start(self) -> "ProcessTracker":
        self.scan()
        self._thread = threading.Thread(target=self._run, name="pdserve-process-tracker", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.scan()

    def alive(self, names: tuple[str, ...] | None = None) -> list[psutil.Process]:
        """The recorded processes still running (the same process: pid and create time match)."""
        with self._lock:
            items = list(self.seen.items())
        out = []
        for pid, (created, name) in items:
            if names is not None and name not in names:
                continue
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def end_all(self, grace_s: float, kill_at_once: Collection[int] = (),
                kill_wait_s: float = 5.0) -> tuple[list[str], list[str]]:
        """Ends every recorded process still running as `ray.shutdown` ends Ray's: SIGTERM, up to
        `grace_s` to exit, SIGKILL for the rest, all at once (Ray does it one process after the
        other); the pids of `kill_at_once` (actors whose servers stopped: what `ray.kill` does to
        them) get SIGKILL first. A killed process may take seconds to go on a loaded machine (the
        kernel frees a model's memory): up to `kill_wait_s` is waited for them. Returns ('pid name'
        of those that got SIGKILL after their grace, of those killed and still exiting)."""
        self.scan()
        running = self.alive()
        at_once = [p for p in running if p.pid in kill_at_once and _signal(p, signal.SIGKILL)]
        for p in running:
            if p not in at_once:
                _signal(p, signal.SIGTERM)
        stayed = [p for p in wait_gone(running, grace_s) if p not in at_once]
        killed = [f"{p.pid} {_name(p)}" for p in stayed if _signal(p, signal.SIGKILL)]
        left = [f"{p.pid} {_name(p)}" for p in wait_gone(at_once + stayed, kill_wait_s)]
        return killed, left

    def kill_leftovers(self, sig: int = signal.SIGKILL) -> list[str]:
        """Sends `sig` to every recorded process still running; returns 'pid name' of each."""
        self.scan()
        killed = []
        for p in self.alive():
            try:
                p.send_signal(sig)
                killed.append(f"{p.pid} {p.name()}")
            except psutil.Error:
                continue
        return killed


def _signal(p: psutil.Process, sig: int) -> bool:
    try:
        p.send_signal(sig)
        return True
    except psutil.Error:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


def run_bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> bool:
    """Runs `fn` in a daemon thread; True if it returned (or raised) within timeout_s."""
    done = threading.Event()

    def target() -> None:
        try:
            fn()
        except Exception:
            logger.warning("%s failed", what, exc_info=True)
        finally:
            done.set()

    threading.Thread(target=target, name=f"pdserve-shutdown-{what}", daemon=True).start()
    if done.wait(max(0.0, timeout_s)):
        return True
    logger.warning("%s did not finish within %.1fs; giving up on it", what, timeout_s)
    return False


def gcs_reachable(address: str, timeout_s: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return True  # nothing to check against
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    return True


class RayWatchdog:
    """Raises `SIGTERM` in this process once Ray is gone (module docstring, step 2).

    `tracker`: for a Ray we started, the GCS and raylet processes it recorded; `gcs_address`:
    for a joined cluster, checked by connecting to it; `misses` checks in a row must fail.
    `stopping`: set once a stop was asked for (a signal); from then on Ray going away is part of
    the stop, not news: the watchdog neither logs it nor raises SIGTERM again."""

    def __init__(self, tracker: ProcessTracker | None, gcs_address: str | None, *, interval_s: float = 1.0,
                 misses: int = 3, on_dead: Callable[[str], None] | None = None,
                 stopping: threading.Event | None = None) -> None:
        self.tracker = tracker
        self.gcs_address = gcs_address
        self.interval_s = interval_s
        self.misses = misses
        self.on_dead = on_dead or _raise_sigterm
        self.stopping = stopping
        self.dead_reason: str | None = None
        self._daemons = {p.pid for p in tracker.alive(RAY_DAEMONS)} if tracker is not None else set()
        self._stop = threading.Event()

    def start(self) -> "RayWatchdog":
        threading.Thread(target=self._run, name="pdserve-ray-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> str | None:
        """Why Ray is gone, or None while it is there."""
        if self._daemons and self.tracker is not None:
            alive = {p.pid for p in self.tracker.alive(RAY_DAEMONS)}
            gone = self._daemons - alive
            if gone:
                return f"Ray's {'/'.join(RAY_DAEMONS)} process(es) {sorted(gone)} exited"
        if self.gcs_address and not gcs_reachable(self.gcs_address):
            return f"Ray's GCS at {self.gcs_address} is unreachable"
        return None

    def _run(self) -> None:
        missed = 0
        while not self._stop.wait(self.interval_s):
            if self.stopping is not None and self.stopping.is_set():
                return
            reason = self.check()
            missed = missed + 1 if reason else 0
            if reason and (missed >= self.misses or self._daemons):
                if self.stopping is not None and self.stopping.is_set():
                    return  # asked to stop meanwhile: the signal took Ray down too
                self.dead_reason = reason
                logger.error("%s; shutting down", reason)
                self.on_dead(reason)
                return


def _raise_sigterm(reason: str) -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class HardDeadline:
    """Once armed, kills the tracked leftovers and exits the process at `deadline_s` unless
    `cancel()`ed first (module docstring, step 4)."""

    def __init__(self, tracker: ProcessTracker | None, deadline_s: float, exit_code: int = 1) -> None:
        self.tracker = tracker
        self.deadline_s = deadline_s
        self.exit_code = exit_code
        self._cancel = threading.Event()

    def arm(self) -> "HardDeadline":
        threading.Thread(target=self._run, name="pdserve-shutdown-deadline", daemon=True).start()
        return self

    def cancel(self) -> None:
        self._cancel.set()

    def _run(self) -> None:
        if self._cancel.wait(self.deadline_s):
            return
        killed = self.tracker.kill_leftovers() if self.tracker is not None else []
        logger.error("shutdown not done within %.0fs; killed %s and exiting", self.deadline_s, killed or "nothing")
        hard_exit(self.exit_code)


def hard_exit(code: int) -> None:
    """Exits now, skipping atexit hooks (Ray's would wait a minute for a dead GCS)."""
    for stream in ("stdout", "stderr"):
        try:
            getattr(sys, stream).flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(code)


def wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    left = processes
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _running(p)]
    return left


def pid_running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie awaiting its parent's wait() does not)."""
    try:
        return _running(psutil.Process(pid))
    except psutil.Error:
        return False


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
