"""The official openai client, streaming through create_app(ClusterBackend(...)) to fake gRPC workers.

The workers run on their own event loop in a thread; the app (and the backend, started lazily
on its first request) runs on uvicorn's loop in another.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.directory import StaticDirectory
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement.registry import make_policy
from pdserve.router.http.server import create_app
from tests.router.conftest import MODEL, CharTokenizer, ServerThread
from tests.router.fake_workers import Cluster, FakeWorker, Script, expected_tokens

TOK = CharTokenizer()


class LoopThread:
    """An event loop in a daemon thread; `call` runs a coroutine there and waits (bounded)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Any, timeout_s: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@pytest.fixture
def served() -> Iterator[tuple[str, dict[str, FakeWorker], RouterMetrics]]:
    loop = LoopThread()
    shared = Cluster()
    workers = {
        "p0": FakeWorker("p0", "prefill", shared),
        "d0": FakeWorker("d0", "decode", shared, Script(die_after_tokens=2)),
        "d1": FakeWorker("d1", "decode", shared),
    }
    try:
        for worker in workers.values():
            loop.call(worker.start())
        metrics = RouterMetrics()
        backend = ClusterBackend(
            StaticDirectory([w.endpoint for w in workers.values()]), make_policy("round-robin"), TOK, MODEL, 128,
            stats_interval_s=0.05, health_timeout_s=0.5, rpc_timeout_s=1.0, kv_deadline_s=1.0, metrics=metrics,
        )
        with ServerThread(create_app(backend, metrics=metrics)) as server:
            yield server.url, workers, metrics
    finally:
        for worker in workers.values():
            loop.call(worker.stop())
        loop.stop()


def chat_prompt(content: str) -> list[int]:
    return TOK.encode(TOK.apply_chat_template([{"role": "user", "content": content}]), add_special_tokens=False)


def test_openai_streaming_through_the_cluster(served):
    url, workers, metrics = served
    assert httpx.get(url + "/health", timeout=5).json()["backend"]["healthy"] is True
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)

    # d0 dies after streaming two tokens: the request migrates to d1 and the client sees one stream
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    prompt = chat_prompt("hi")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(map(chr, expected_tokens(prompt, 8)))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 8)
    rid = workers["p0"].called("Prefill")[0]
    assert workers["d0"].called("Decode") == [rid]
    assert [g.request_id for g in workers["d1"].generate_requests] == [f"{rid}.1"]
    assert metrics.registry.get_sample_value("pdserve:request_recoveries_total", {"kind": "migrate"}) == 1

    # d0 is gone: the next request goes to d1 (disaggregated again), not streamed
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=4)
    assert r.choices[0].text == "".join(map(chr, expected_tokens(TOK.encode("abc"), 4)))
    assert len(workers["d1"].called("Decode")) == 1
    health = httpx.get(url + "/health", timeout=5).json()["backend"]
    assert health["workers"]["d0"]["healthy"] is False and health["workers"]["d1"]["healthy"] is True
