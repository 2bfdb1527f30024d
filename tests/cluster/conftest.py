"""Helpers for cluster tests: free ports, subprocesses whose whole tree is checked at the end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable

import httpx
import psutil

from pdserve.loadgen.launcher import free_port  # noqa: F401 (the cluster tests import it from here)

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
    return subprocess.Popen([sys.executable, "-m", "pdserve.launcher.cli", *args], cwd=REPO, stdout=log,
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


def assert_all_gone(proc, port, addresses, tree, t0, bound_s: float = 15.0):
    """`pdserve up` (`proc`), every process of `tree` gone and the router's and workers' ports free
    within `bound_s` of `t0` (when the signal went)."""
    try:
        proc.wait(bound_s)
    except Exception:
        pass
    left = wait_gone(tree, max(0.0, bound_s - (time.monotonic() - t0)))
    elapsed = time.monotonic() - t0
    assert proc.poll() is not None, f"pdserve up still running {elapsed:.1f}s after the signal"
    assert left == [], f"still running {elapsed:.1f}s after the signal: {left}"
    assert elapsed < bound_s
    for host, p in [("127.0.0.1", port)] + [tuple(a.rsplit(":", 1)) for a in addresses]:
        assert free_within(host, int(p), t0 + bound_s), f"{host}:{p} still in use: {port_holders(int(p))}"


def free_within(host: str, port: int, until: float) -> bool:
    while True:
        try:
            socket.create_server((host, port)).close()
            return True
        except OSError:
            if time.monotonic() > until:
                return False
            time.sleep(0.2)


def port_holders(port: int) -> list[str]:
    out = []
    for c in psutil.net_connections("tcp"):
        if c.laddr and c.laddr.port == port:
            try:
                name = psutil.Process(c.pid).cmdline() if c.pid else None
            except psutil.Error:
                name = None
            out.append(f"{c.status} pid={c.pid} {name}")
    return out


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""
