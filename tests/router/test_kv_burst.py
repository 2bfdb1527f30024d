"""A burst beyond the KV capacity queues instead of failing (issue 30, item 10), through the HTTP
app to real engines: in-process gRPC workers with a tiny random model and a cache that holds
three requests at once, KV over the in-process fake backend.

Disaggregated: the decode worker's Reserve waits in line for blocks; colocated: the engine's
waiting queue. Past the router's bounds: 429 (queue full) or 503 (waited too long), both with
Retry-After and an OpenAI error body; a prompt that can never fit gets 400 at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.sampling_params import SamplingParams
from pdserve.worker.server import WorkerConfig, WorkerServer
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.directory import StaticDirectory, WorkerEndpoint
from pdserve.router.http.server import create_app
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement.registry import make_policy
from tests.router.conftest import CharTokenizer, ServerThread, wait_until

MODEL = "random:tiny-qwen2"
BLOCK_SIZE = 4
NUM_BLOCKS = 27  # a request below: ~25 prompt tokens + 8 output = 9 blocks, so 3 fit at once
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, WorkerServer]]:
    config = EngineConfig(model=MODEL, device="cpu", dtype="float32",
                          cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS))
    servers = {}
    try:
        for role in ("prefill", "decode", "mixed"):
            server = WorkerServer(WorkerConfig(f"{role}-0", role, config, kv_backend="fake"))
            server.start()
            servers[role] = server
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@contextmanager
def router(workers: dict[str, WorkerServer], mode: str,
           **options) -> Iterator[tuple[str, ClusterBackend, RouterMetrics]]:
    roles = ("mixed",) if mode == "colocated" else ("prefill", "decode")
    endpoints = [WorkerEndpoint(workers[r].config.worker_id, r, workers[r].address) for r in roles]  # type: ignore[arg-type]
    metrics = RouterMetrics()
    backend = ClusterBackend(StaticDirectory(endpoints), make_policy("round-robin"), CharTokenizer(), MODEL, 128,
                             mode=mode, stats_interval_s=0.05, metrics=metrics, **options)
    with ServerThread(create_app(backend, metrics=metrics)) as server:
        yield server.url, backend, metrics


def body(i: int, content: str | None = None) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content or f"q{i:03d}xx"}],
            "max_tokens": MAX_TOKENS, "temperature": 0}


async def burst(url: str, bodies: list[dict], timeout_s: float = 60.0) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))


def assert_all_free(workers: dict[str, WorkerServer]) -> None:
    for server in workers.values():
        assert wait_until(lambda: not server.engine.requests, timeout_s=5), (server.config.role, server.engine.requests)
        bm = server.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks, server.config.role
        assert not server.engine.scheduler.pending_reservations


def hog(server: WorkerServer) -> list[int]:
    """Reserves all but 2 of the decode worker's blocks (a transfer that never comes)."""
    prompt = [5] * ((NUM_BLOCKS - 2) * BLOCK_SIZE)
    return server.loop.submit(lambda e: e.reserve("hog", prompt, SamplingParams(max_tokens=1))).result(5)


def release_hog(server: WorkerServer) -> None:
    server.loop.submit(lambda e: e.abort_request("hog")).result(5)


def assert_retry_later(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_burst_ten_times_the_kv_capacity_is_served_in_turn(workers, mode):
    # the cache holds 3 requests; 30 arrive at once: all wait their turn and are served
    with router(workers, mode) as (url, backend, metrics):
        t0 = time.monotonic()
        responses = asyncio.run(burst(url, [body(i) for i in range(30)]))
        elapsed = time.monotonic() - t0
        assert [r.status_code for r in responses] == [200] * 30, [r.text for r in responses if r.status_code != 200]
        for r in responses:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] in ("length", "stop") and r.json()["usage"]["completion_tokens"] >= 1
        assert elapsed < 60
        assert backend.num_queued == 0
        assert metrics.registry.get_sample_value("pdserve:queue_wait_seconds_count") == 30
        assert metrics.registry.get_sample_value("pdserve:requests_waiting") == 0
    assert_all_free(workers)


def test_the_decode_worker_reserves_in_arrival_order(workers):
    decode = workers["decode"]
    hog(decode)
    try:
        with router(workers, "disaggregated") as (url, backend, _):
            async def staggered():
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    tasks = []
                    for i in range(4):
                        tasks.append(asyncio.create_task(client.post("/v1/chat/completions", json=body(i))))
                        await asyncio_wait_until(lambda: len(decode.engine.scheduler.pending_reservations) == i + 1)
                    order = [s.request_id for s in decode.engine.scheduler.pending_reservations]
                    release_hog(decode)
                    return order, await asyncio.gather(*tasks)

            order, responses = asyncio.run(staggered())
            assert len(order) == 4 and len(set(order)) == 4
            assert [r.status_code for r in responses] == [200] * 4
    finally:
        release_hog(decode)
    assert_all_free(workers)


async def asyncio_wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_past_the_queue_bound_a_429_with_retry_after(workers):
    decode = workers["decode"]
    hog(decode)
    try:
        with router(workers, "disaggregated", max_queued_requests=2) as (url, backend, metrics):
            async def main():
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    waiting = [asyncio.create_task(client.post("/v1/chat/completions", json=body(i))) for i in range(2)]
                    await asyncio_wait_until(lambda: len(decode.engine.scheduler.pending_reservations) == 2)
                    refused = await client.post("/v1/chat/completions", json=body(9))
                    release_hog(decode)
                    return refused, await asyncio.gather(*waiting)

            refused, served = asyncio.run(main())
            assert_retry_later(refused, 429, "overloaded")
            assert "queued" in refused.json()["error"]["message"]
            assert [r.status_code for r in served] == [200, 200]
            assert metrics.registry.get_sample_value("pdserve:requests_rejected_total", {"reason": "queue_full"}) == 1
    finally:
        release_hog(decode)
    assert_all_free(workers)


def test_past_the_wait_bound_a_503_with_retry_after_and_the_slot_is_freed(workers):
    decode = workers["decode"]
    hog(decode)
    try:
        with router(workers, "disaggregated", queue_timeout_s=1.0) as (url, backend, metrics):
            t0 = time.monotonic()
            [r] = asyncio.run(burst(url, [body(0)]))
            assert_retry_later(r, 503, "service_unavailable")
            assert 1.0 <= time.monotonic() - t0 < 5
            assert "waited" in r.json()["error"]["message"]
            # the waiting reservation left the decode worker's line; the worker is not blamed
            assert wait_until(lambda: not decode.engine.scheduler.pending_reservations)
            assert set(decode.engine.requests) == {"hog"}
            assert backend.num_queued == 0
            assert metrics.registry.get_sample_value("pdserve:requests_rejected_total",
                                                     {"reason": "queue_timeout"}) == 1
            assert all(w.healthy for w in backend.pool.workers.values())
    finally:
        release_hog(decode)
    assert_all_free(workers)


def test_a_client_that_leaves_while_waiting_frees_its_place(workers):
    decode = workers["decode"]
    hog(decode)
    try:
        with router(workers, "disaggregated") as (url, backend, _):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/chat/completions", json=body(0), timeout=0.5)
            assert wait_until(lambda: not decode.engine.scheduler.pending_reservations)
            assert wait_until(lambda: backend.num_queued == 0)
            assert set(decode.engine.requests) == {"hog"}
    finally:
        release_hog(decode)
    assert_all_free(workers)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_prompt_that_can_never_fit_is_refused_at_once(workers, mode):
    with router(workers, mode) as (url, _, _):
        t0 = time.monotonic()
        [r] = asyncio.run(burst(url, [body(0, content="z" * 100)]))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "maximum context length is 108 tokens" in error["message"], error
        assert error["code"] == "context_length_exceeded"
        assert time.monotonic() - t0 < 5
    assert_all_free(workers)
