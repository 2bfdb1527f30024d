"""Helpers for cluster tests: free ports, subprocesses whose whole tree is checked at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

import httpx
import psutil

from loadgen.launcher import free_port  # noqa: F401 (the cluster tests import it from here)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
# A model with a tokenizer (the router needs one) that loads in about a second.
MODEL = "random:smollm2-135m"



def cluster_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", **extra)
    env.pop("RAY_ADDRESS", None)
    return env


def pdserve(*args: str, log_path: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`pdserve <args>` in the background, stdout and stderr to log_path."""
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", *args], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env=env or cluster_env(), start_new_session=True)


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float, log_path: str) -> dict:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            r = httpx.get(f"{base_url}/health", timeout=2)
            if r.status_code == 200:
                return r.json()
            last = r.text
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.5)
    raise AssertionError(f"not healthy within {timeout_s}s (last: {last}):\n{_tail(log_path)}")


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive(processes: Iterable[psutil.Process]) -> list[str]:
    """Those still running (zombies awaiting their parent's wait() count as gone)."""
    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
    """Sends `sig`, waits; kills the whole process group if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise
    return proc.returncode


def kill_group(proc: subprocess.Popen) -> None:
    """Last resort for a test that failed: the process group we started (start_new_session)."""
    for p in [*descendants(proc.pid), psutil.Process(proc.pid)] if proc.poll() is None else descendants(proc.pid):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""
