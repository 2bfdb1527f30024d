"""The router pays its first request's one-time costs before serving (OpenAIServing.warm_up):
its own paths run on a throw-away request, nothing is counted, and a cluster backend sends each
worker one one-token Generate."""

from __future__ import annotations

import asyncio

from router.cluster.backend import ClusterBackend
from router.cluster.directory import StaticDirectory
from router.http.server import create_app
from router.metrics import RouterMetrics
from router.placement.registry import make_policy
from tests.router.conftest import MODEL, CharTokenizer, FakeBackend
from tests.router.fake_workers import Cluster, FakeWorker
from tests.router.test_cluster_openai import LoopThread


def test_warm_up_runs_the_http_side_without_the_backend_or_the_metrics():
    backend = FakeBackend()
    metrics = RouterMetrics()
    app = create_app(backend, metrics=metrics)
    from prometheus_client import generate_latest

    def samples() -> list[str]:
        return [line for line in generate_latest(metrics.registry).decode().splitlines() if "_created" not in line]

    before = samples()
    seconds = asyncio.run(app.state.serving.warm_up())
    assert seconds >= 0
    assert backend.requests == []  # FakeBackend has no warm_up: nothing generated
    assert samples() == before


def test_cluster_warm_up_sends_each_worker_one_token():
    loop = LoopThread()
    shared = Cluster()
    workers = [FakeWorker("m0", "mixed", shared), FakeWorker("m1", "mixed", shared)]
    try:
        for worker in workers:
            loop.call(worker.start())
        backend = ClusterBackend(StaticDirectory([w.endpoint for w in workers]), make_policy("round-robin"),
                                 CharTokenizer(), MODEL, 128, stats_interval_s=0.05, health_timeout_s=0.5,
                                 rpc_timeout_s=1.0, kv_deadline_s=1.0)
        app = create_app(backend)
        loop.call(app.state.serving.warm_up(timeout_s=5.0))
        for worker in workers:
            generates = [r for method, r in worker.calls if method == "Generate"]
            assert generates == [f"__warmup-router-{worker.endpoint.worker_id}"]
            (req,) = worker.generate_requests
            assert req.params.max_tokens == 1 and 0 < len(req.prompt_token_ids) < 16
        assert backend.num_queued == 0 and not backend._flights  # not a request of the router's
        loop.call(backend.close())
    finally:
        for worker in workers:
            loop.call(worker.stop())
        loop.stop()
