"""`pdserve up` as a user runs it: local Ray, one prefill + one decode worker (KV over UCX),
the router on a free port; a completion and a chat completion; SIGTERM leaves no process."""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.cluster.conftest import MODEL, descendants, free_port, kill_group, pdserve, stop, wait_gone, wait_healthy

pytestmark = pytest.mark.timeout(180)


def test_up_serves_and_sigterm_leaves_no_process(tmp_path):
    port = free_port()
    log = str(tmp_path / "up.log")
    proc = pdserve("up", "--model", MODEL, "--port", str(port), "--kv-cache-gib", "0.05", "--api-key", "k3y",
                   "--policy", "least-loaded", "--startup-timeout-s", "120", log_path=log)
    base = f"http://127.0.0.1:{port}"
    try:
        health = wait_healthy(base, proc, 150, log)
        workers = health["backend"]["workers"]
        assert sorted(w["role"] for w in workers.values()) == ["decode", "prefill"]
        assert all(w["healthy"] for w in workers.values())
        assert set(workers) == {"pdserve:default:prefill:0", "pdserve:default:decode:0"}

        auth = {"Authorization": "Bearer k3y"}
        assert httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10).status_code == 401
        r = httpx.post(f"{base}/v1/completions", headers=auth, timeout=60,
                       json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4
        assert body["choices"][0]["finish_reason"] == "length"
        r = httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3

        tree = descendants(proc.pid)
        names = [p.name() for p in tree]
        assert "raylet" in names and "gcs_server" in names, names
        assert sum("WorkerActo" in n for n in names) == 2, names
        assert stop(proc, signal.SIGTERM, timeout_s=60) == 0
        assert wait_gone(tree, 15) == []
    finally:
        if proc.poll() is None:
            kill_group(proc)
    with open(log) as f:
        text = f.read()
    assert "workers ready" in text and "shutting down" in text
