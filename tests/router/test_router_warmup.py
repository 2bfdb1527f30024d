"""The router pays its first request's one-time costs before serving (OpenAIServing.warm_up):
its own paths run on a throw-away request, nothing is counted, and a cluster backend sends each
worker one one-token Generate."""

from __future__ import annotations

import asyncio

from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.directory import StaticDirectory
from pdserve.router.http.server import create_app
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement.registry import make_policy
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


def test_cluster_warm_up_moves_kv_over_every_pair_and_a_joiner_is_placed_only_once_warmed():
    """Disaggregated: the warm-up runs a two-token PD request over each prefill -> decode pair
    (Reserve and Decode on D, Prefill on P), twice, outside the router's metrics and queue. A
    worker that joins later is left out of placement until its own pairs are warmed; one back
    after a failed check is warmed while it serves."""
    from tests.router.fake_workers import MutableDirectory

    loop = LoopThread()
    shared = Cluster()
    p0, d0, d1 = (FakeWorker("p0", "prefill", shared), FakeWorker("d0", "decode", shared),
                  FakeWorker("d1", "decode", shared))
    workers = [p0, d0, d1]
    metrics = RouterMetrics()
    try:
        for worker in workers:
            loop.call(worker.start())
        directory = MutableDirectory([p0.endpoint, d0.endpoint])
        backend = ClusterBackend(directory, make_policy("round-robin"), CharTokenizer(), MODEL, 128,
                                 stats_interval_s=0.05, health_timeout_s=0.5, rpc_timeout_s=1.0,
                                 kv_deadline_s=1.0, metrics=metrics)
        app = create_app(backend, metrics=metrics)
        loop.call(app.state.serving.warm_up(timeout_s=5.0))
        prefills = p0.called("Prefill")
        assert prefills == ["__warmup-kv-p0-d0-full-0", "__warmup-kv-p0-d0-full-1"]
        assert d0.called("Reserve") == prefills and d0.called("Decode") == prefills
        assert backend.num_queued == 0 and not backend._flights
        from prometheus_client import generate_latest

        text = generate_latest(metrics.registry).decode()
        assert "\npdserve:kv_transfer_bytes_total{" not in text  # nothing of the router's counted
        assert "\npdserve:requests_total{" not in text
        assert backend.pool.on_healthy is not None

        # a decode worker joins: out of placement until p0 -> d1 is warmed
        gate = asyncio.Event()
        original = backend.warmup._warm_once

        async def held(prefill, decode, *args):
            await gate.wait()
            return await original(prefill, decode, *args)

        backend.warmup._warm_once = held
        directory.entries.append(d1.endpoint)
        loop.call(backend.refresh())
        joiner = backend.pool.workers["d1"]
        assert joiner.healthy and joiner.warming
        assert "d1" not in {s.worker_id for s in backend.snapshot().workers}
        assert backend.pool.describe()["d1"]["warming"] is True
        loop.call(_set(gate))
        for _ in range(100):
            if not joiner.warming:
                break
            loop.call(asyncio.sleep(0.02))
        assert not joiner.warming
        assert "d1" in {s.worker_id for s in backend.snapshot().workers}
        assert d1.called("Prefill") == [] and p0.called("Prefill")[2:] == ["__warmup-kv-p0-d1-full-0",
                                                                           "__warmup-kv-p0-d1-full-1"]
        assert d1.called("Decode") == p0.called("Prefill")[2:]

        # back after a failed check: warmed again while it serves, not left out
        gate.clear()
        backend.pool.mark_down(joiner, "a missed poll", cancel_streams=False)
        loop.call(backend.refresh())
        assert joiner.healthy and not joiner.warming
        assert "d1" in {s.worker_id for s in backend.snapshot().workers}
        loop.call(_set(gate))
        for _ in range(100):
            if len(p0.called("Prefill")) == 6:
                break
            loop.call(asyncio.sleep(0.02))
        assert p0.called("Prefill")[4:] == ["__warmup-kv-p0-d1-full-0", "__warmup-kv-p0-d1-full-1"]
        loop.call(backend.close())
    finally:
        for worker in workers:
            loop.call(worker.stop())
        loop.stop()


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_a_pair_whose_warm_up_fails_is_logged_and_its_worker_serves():
    from tests.router.fake_workers import Script

    loop = LoopThread()
    shared = Cluster()
    p0, d0 = FakeWorker("p0", "prefill", shared), FakeWorker("d0", "decode", shared, Script(kv_compat="other"))
    p0.script.kv_compat = "mine"
    try:
        for worker in (p0, d0):
            loop.call(worker.start())
        backend = ClusterBackend(StaticDirectory([p0.endpoint, d0.endpoint]), make_policy("round-robin"),
                                 CharTokenizer(), MODEL, 128, stats_interval_s=0.05, health_timeout_s=0.5,
                                 rpc_timeout_s=1.0, kv_deadline_s=1.0)
        loop.call(backend.start())
        # kv_compat keys differ: no pair to warm
        assert loop.call(backend.warm_pairs([5, 6, 7])) == 0 and p0.called("Prefill") == []
        d0.script.kv_compat = "mine"
        loop.call(backend.refresh())

        async def broken(*args, **kwargs):
            raise RuntimeError("no route")

        backend.pool.workers["p0"].client.prefill = broken
        assert loop.call(backend.warm_pairs([5, 6, 7])) == 0
        assert d0.called("Abort")  # the reservation was freed
        assert {s.worker_id for s in backend.snapshot().workers} == {"p0", "d0"}
        loop.call(backend.close())
    finally:
        for worker in (p0, d0):
            loop.call(worker.stop())
        loop.stop()
