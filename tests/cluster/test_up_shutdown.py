"""Bounded shutdown of a real `pdserve up` (tiny random model, CPU): SIGTERM to its whole
process group (what `timeout` and supervisors do, so Ray's daemons get it too), or Ray dying
under it, ends every process it started within 15 s and frees the ports; a stop, idle or under
load, says nothing of the fallback. (SIGTERM to the whole process group after serving:
tests/cluster/test_up_e2e.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.cluster.conftest import (MODEL, assert_all_gone, descendants, free_port, kill_group, pdserve,
                                   wait_healthy)

pytestmark = pytest.mark.timeout(120)

BOUND_S = 15.0


def _start(tmp_path):
    port = free_port()
    log = str(tmp_path / "up.log")
    proc = pdserve("up", "--model", MODEL, "--port", str(port), "--kv-cache-gib", "0.05",
                   "--startup-timeout-s", "90", log_path=log)
    try:
        health = wait_healthy(f"http://127.0.0.1:{port}", proc, 90, log)
    except BaseException:
        kill_group(proc)  # a cluster that did not come up must not outlive the test
        raise
    addresses = [w["address"] for w in health["backend"]["workers"].values()]
    tree = descendants(proc.pid)
    names = [p.name() for p in tree]
    assert "raylet" in names and "gcs_server" in names and sum("WorkerActo" in n for n in names) == 2, names
    return proc, port, addresses, tree, log


def test_ray_dying_under_it_ends_everything_within_15s(tmp_path):
    proc, port, addresses, tree, log = _start(tmp_path)
    try:
        gcs = next(p for p in tree if p.name() == "gcs_server")
        t0 = time.monotonic()
        gcs.kill()
        assert_all_gone(proc, port, addresses, tree, t0)
    finally:
        if proc.poll() is None or any(p.is_running() for p in tree):
            kill_group(proc)
            for p in tree:
                try:
                    p.kill()
                except psutil.Error:
                    pass
    with open(log) as f:
        text = f.read()
    assert "gcs_server" in text and "shutting down" in text, text[-2000:]


# What the bounded shutdown and the router log when a step had to be abandoned, leftovers were
# killed or requests were cancelled under the server: never on a clean stop, under load or not.
FALLBACK_WARNINGS = ("giving up on it", "killed what was left", "did not stop within", "shutdown not done within",
                     "closing the router backend failed", "timeout graceful shutdown exceeded",
                     "Exception in ASGI application")
# A clean stop: the router drains, the workers stop at once, Ray ends (~1 s of grace), the process
# exits without the interpreter's teardown. It took 7.5-11 s on the loaded 2-core machine while
# the workers tore UCX down before their kill and the interpreter garbage-collected its heap at exit.
CLEAN_EXIT_S = 7.0


@pytest.mark.parametrize("how", ["ctrl-c", pytest.param("sigterm", marks=pytest.mark.slow)])
def test_a_clean_stop_is_quick_and_quiet(tmp_path, how):
    """Ctrl-C (SIGINT to the foreground process group; Ray's daemons block it) or SIGTERM to
    `pdserve up` alone: the workers stop on request, Ray shuts down, every process it started is
    gone, the exit status is 0 and nothing of the fallback shows (its warnings mean a real problem)."""
    proc, port, addresses, tree, log = _start(tmp_path)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        t0 = time.monotonic()
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(BOUND_S)
        except Exception:
            pass
        exited_s = time.monotonic() - t0
        assert_all_gone(proc, port, addresses, tree, t0)
        assert exited_s < CLEAN_EXIT_S, f"pdserve up took {exited_s:.1f}s to exit"
    finally:
        if proc.poll() is None or any(p.is_running() for p in tree):
            kill_group(proc)
            for p in tree:
                try:
                    p.kill()
                except psutil.Error:
                    pass
    with open(log) as f:
        text = f.read()
    assert "shutting down" in text, text[-2000:]
    for warning in FALLBACK_WARNINGS:
        assert warning not in text, text[-3000:]
    assert proc.returncode == 0, text[-2000:]


def _metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples in a /metrics page (all its label sets)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _group_left(pgid: int) -> list[str]:
    """The processes of process group `pgid` still running (zombies awaiting a reaper do not count)."""
    left = []
    for p in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {p.info['name']}")
        except (ProcessLookupError, psutil.Error):
            continue
    return left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm-group", "sigint-group"])
def test_a_stop_under_load_is_quick_and_quiet(tmp_path, sig):
    """SIGTERM to the process group (a supervisor: Ray's daemons get it too) or SIGINT to it
    (Ctrl-C: they block it) while a bounded load (pdserve-loadgen, 32 requests, 8 at a time)
    streams tokens on the loaded machine: every process of the group and below it is gone and
    the ports are free within 15 s, the exit status is 0, and nothing of the fallback is logged:
    the drain ends the requests still in flight, the workers stop at once, Ray ends as
    ray.shutdown would end it."""
    proc, port, addresses, tree, log = _start(tmp_path)
    base = f"http://127.0.0.1:{port}"
    load = subprocess.Popen([sys.executable, "-m", "pdserve.loadgen.cli", "run", "--url", base, "--model", MODEL,
                             "--endpoint", "completions", "--num-requests", "32", "--concurrency", "8",
                             "--rate", "inf", "--input-len", "fixed:256", "--output-len", "fixed:128",
                             "--ignore-eos", "--no-progress", "--timeout", "60"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # tokens streamed, and requests still in the workers' batches: a stop under load
            page = httpx.get(f"{base}/metrics", timeout=10).text
            if _metric(page, "pdserve:generation_tokens_total") > 0 and _metric(page, "pdserve:num_requests_running"):
                break
            assert load.poll() is None and time.monotonic() < deadline, "the load never got going"
            time.sleep(0.2)
        assert load.poll() is None  # still sending: the signal meets requests in flight
        t0 = time.monotonic()
        os.killpg(proc.pid, sig)
        assert_all_gone(proc, port, addresses, tree, t0, BOUND_S)
        left = _group_left(proc.pid)
        assert left == [], f"still in the process group {time.monotonic() - t0:.1f}s after the signal: {left}"
    finally:
        load.kill()
        load.wait(10)
        if proc.poll() is None or any(p.is_running() for p in tree):
            kill_group(proc)
            for p in tree:
                try:
                    p.kill()
                except psutil.Error:
                    pass
    with open(log) as f:
        text = f.read()
    assert "shutting down" in text, text[-2000:]
    for warning in FALLBACK_WARNINGS:
        assert warning not in text, text[-3000:]
    assert proc.returncode == 0, text[-2000:]
