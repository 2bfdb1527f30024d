"""`pdserve up` as a user runs it: the README's quick start (local Ray, the embedded SmolLM2, one
prefill + one decode worker with KV over UCX, the router on a free port) with an API key; the
official `openai` client, plain and streamed; a worker killed with -9 comes back on a new
address and serves again; SIGTERM to the process group leaves no process and no port taken
within 15 s. One server for all of it: a cluster's start-up is most of the test's time."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.cluster.conftest import (assert_all_gone, descendants, free_port, kill_group, pdserve,
                                   wait_healthy)

pytestmark = pytest.mark.timeout(300)


def test_up_default_smollm2_openai_client_restart_and_sigterm(tmp_path):
    openai = pytest.importorskip("openai")
    port = free_port()
    log = str(tmp_path / "up.log")
    proc = pdserve("up", "--port", str(port), "--kv-cache-gib", "0.05", "--api-key", "k3y",
                   "--policy", "least-loaded", "--startup-timeout-s", "180", log_path=log)
    base = f"http://127.0.0.1:{port}"
    try:
        health = wait_healthy(base, proc, 200, log)
        workers = health["backend"]["workers"]
        assert sorted(w["role"] for w in workers.values()) == ["decode", "prefill"]
        assert all(w["healthy"] for w in workers.values())
        assert set(workers) == {"pdserve:default:prefill:0", "pdserve:default:decode:0"}

        auth = {"Authorization": "Bearer k3y"}
        unauthorized = httpx.post(f"{base}/v1/completions", json={"model": "smollm2", "prompt": "hi"}, timeout=10)
        assert unauthorized.status_code == 401
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="k3y", max_retries=0, timeout=120)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(model="smollm2", messages=question, max_tokens=24, temperature=0)
        assert "Paris" in chat.choices[0].message.content
        assert chat.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(model="smollm2", messages=question, max_tokens=24,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            chat.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens
        comp = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=5,
                                         temperature=0)
        assert comp.usage.completion_tokens == 5 and comp.choices[0].finish_reason == "length"
        assert [m.id for m in client.models.list().data] == ["smollm2"]

        # kill -9 one worker: Ray restarts it, the router sees its new address and uses it again.
        actors = [p for p in descendants(proc.pid) if "WorkerActo" in p.name()]
        assert len(actors) == 2, [p.name() for p in descendants(proc.pid)]
        before = {k: w["address"] for k, w in workers.items()}
        actors[0].kill()
        deadline = time.monotonic() + 60
        while True:
            health = httpx.get(f"{base}/health", timeout=5)  # 503 while no decode worker is up
            workers = health.json()["backend"]["workers"] if health.status_code == 200 else {}
            after = {k: w["address"] for k, w in workers.items()}
            if after.keys() == before.keys() and after != before and all(w["healthy"] for w in workers.values()):
                break
            assert time.monotonic() < deadline, health.text
            time.sleep(0.3)
        assert sum(after[k] != before[k] for k in before) == 1
        r = httpx.post(f"{base}/v1/completions", headers=auth, timeout=60,
                       json={"model": "smollm2", "prompt": "After a restart", "max_tokens": 2})
        assert r.status_code == 200, r.text

        tree = descendants(proc.pid)
        names = [p.name() for p in tree]
        assert "raylet" in names and "gcs_server" in names, names
        assert sum("WorkerActo" in n for n in names) == 2, names
        # SIGTERM to the whole process group (what `timeout` and supervisors send, so Ray's daemons
        # get it too): every process gone and every port free within 15 s
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert_all_gone(proc, port, after.values(), tree, t0)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    with open(log) as f:
        text = f.read()
    assert "workers ready" in text and "shutting down" in text
