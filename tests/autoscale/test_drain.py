"""Resizing a live pool on a local Ray with real workers (the tiny random model, CPU): a worker
added by the resizer serves; draining it while it streams requests cuts none of them, sends it
nothing new, and it leaves (actor killed, placement group removed) once empty."""

from __future__ import annotations

import asyncio
import os

import pytest

ray = pytest.importorskip("ray")

from pdserve.launcher.autoscale.loop import Autoscaler  # noqa: E402
from pdserve.launcher.autoscale.rule import AutoscaleConfig  # noqa: E402
from pdserve.launcher.autoscale.window import ObservedBackend, RequestWindow  # noqa: E402
from pdserve.launcher.cluster.directory import RayDirectory  # noqa: E402
from pdserve.launcher.cluster.pools import ClusterPools, PoolSpec  # noqa: E402
from pdserve.launcher.cluster.resize import PoolResizer  # noqa: E402
from pdserve.engine_args import ENGINE_DEFAULTS, engine_config  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.router.cluster.backend import ClusterBackend  # noqa: E402
from pdserve.router.placement.registry import make_policy  # noqa: E402

pytestmark = pytest.mark.timeout(240)
NAMESPACE = "pdserve-test-autoscale"
TOKENS = 400


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", namespace=NAMESPACE, num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=80 * 1024 * 1024, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def tiny_engine(role: str):
    return engine_config({**ENGINE_DEFAULTS, "model": "random:tiny-llama", "device": "cpu", "kv_cache_gib": 0.02}, role)


def test_drain_cuts_no_streaming_request_and_the_worker_leaves(local_ray):
    from ray.util import placement_group_table

    pools = ClusterPools("drain", NAMESPACE, [PoolSpec("mixed", 1, tiny_engine("mixed"), kv_backend="fake")])
    try:
        pools.start(60)
        pools.wait_ready(60)
        directory = RayDirectory(NAMESPACE, "drain", pools.names, probe_timeout_s=2.0, refresh_interval_s=0)
        resizer = PoolResizer(pools, directory, start_timeout_s=90)
        added = resizer.add("mixed")
        assert added == "pdserve:drain:mixed:1" and pools.names == ["pdserve:drain:mixed:0", added]
        assert resizer.own_group(added)
        group_id = pools.group_of(added).id.hex()

        async def scenario() -> tuple[list, list, set]:
            backend = ClusterBackend(directory, make_policy("round-robin"), object(), "tiny", 512, mode="colocated",
                                     stats_interval_s=0.2, health_timeout_s=2.0)
            window = RequestWindow(slo_ttft=60.0, slo_tpot=60.0)
            served = ObservedBackend(backend, window)
            autoscaler = Autoscaler(AutoscaleConfig(), backend, window, resizer, max_num_seqs=8)
            await backend.start()
            try:
                assert set(backend.pool.workers) == {"pdserve:drain:mixed:0", added}
                params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0)

                async def one(i: int) -> tuple[int, str | None, str | None]:
                    count, reason, where = 0, None, None
                    async for out in served.generate(f"r{i}", [1, 2, 3, 4 + i], params):
                        count += len(out.new_token_ids)
                        if out.finished:
                            reason = out.finish_reason
                            where = out.timing.decode_worker if out.timing is not None else None
                    return count, reason, where

                first = [asyncio.create_task(one(i)) for i in range(6)]
                for _ in range(200):  # until the added worker streams some of them
                    await asyncio.sleep(0.05)
                    if backend.pool.workers[added].num_inflight >= 2:
                        break
                assert backend.pool.workers[added].num_inflight >= 2
                assert autoscaler.pick_to_remove("mixed") in backend.pool.workers
                drain = asyncio.create_task(autoscaler.drain_and_remove(added))
                await asyncio.sleep(0.3)
                assert backend.pool.workers[added].draining and not drain.done()  # its requests still run
                assert [w.worker_id for w in backend.snapshot().workers] == ["pdserve:drain:mixed:0"]
                later = [asyncio.create_task(one(10 + i)) for i in range(3)]  # placed while it drains
                results = await asyncio.gather(*first, *later)
                await asyncio.wait_for(drain, 60)
                await backend.refresh()
                return results[:6], results[6:], set(backend.pool.workers)
            finally:
                await backend.close()

        first, later, left = asyncio.run(scenario())
        assert [(n, r) for n, r, _ in first] == [(TOKENS, "length")] * 6  # none cut
        assert sum(w == added for _, _, w in first) >= 2  # the drained worker finished its own
        assert [(n, r, w) for n, r, w in later] == [(TOKENS, "length", "pdserve:drain:mixed:0")] * 3
        assert left == {"pdserve:drain:mixed:0"}
        assert pools.names == ["pdserve:drain:mixed:0"]
        with pytest.raises(ValueError):
            ray.get_actor(added, namespace=NAMESPACE)
        assert placement_group_table().get(group_id, {}).get("state") in (None, "REMOVED")
    finally:
        pools.shutdown()


def test_a_warm_spare_hides_until_an_addition_takes_it_and_a_drained_worker_parks_as_one(local_ray):
    pools = ClusterPools("spare", NAMESPACE, [PoolSpec("mixed", 1, tiny_engine("mixed"), kv_backend="fake")])
    first = "pdserve:spare:mixed:0"
    try:
        pools.start(60)
        pools.wait_ready(60)
        directory = RayDirectory(NAMESPACE, "spare", pools.names, probe_timeout_s=2.0, refresh_interval_s=0)
        discovering = RayDirectory(NAMESPACE, "spare", None, probe_timeout_s=2.0, refresh_interval_s=0)
        resizer = PoolResizer(pools, directory, start_timeout_s=90)
        spare = resizer.prepare_spare("mixed")
        assert resizer.spares("mixed") == [spare] and spare in pools.names

        async def scenario() -> None:
            async def seen(d) -> list[str]:
                return sorted(e.worker_id for e in await d.refresh())

            assert await seen(directory) == [first]
            assert await seen(discovering) == [first]  # a router that finds workers by name skips it too
            assert ray.get(ray.get_actor(spare, namespace=NAMESPACE).info.remote())["standby"]

            added = resizer.add("mixed")  # takes the spare: nothing starts
            assert added == spare and resizer.spares("mixed") == []
            assert await seen(directory) == [first, spare]
            assert await seen(discovering) == [first, spare]
            backend = ClusterBackend(directory, make_policy("round-robin"), object(), "tiny", 512, mode="colocated",
                                     stats_interval_s=0.2, health_timeout_s=2.0)
            window = RequestWindow(slo_ttft=60.0, slo_tpot=60.0)
            served = ObservedBackend(backend, window)
            autoscaler = Autoscaler(AutoscaleConfig(spares={"mixed": 1}), backend, window, resizer, max_num_seqs=8)
            await backend.start()
            try:
                params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
                where = set()
                for i in range(4):
                    async for out in served.generate(f"s{i}", [1, 2, 3, 4 + i], params):
                        if out.finished:
                            assert out.finish_reason == "length"
                            where.add(out.timing.decode_worker)
                assert where == {first, spare}  # the promoted spare serves
                await asyncio.wait_for(autoscaler.drain_and_remove(spare), 60)  # the pool wants a spare: parked
                assert resizer.spares("mixed") == [spare]
                assert ray.get(ray.get_actor(spare, namespace=NAMESPACE).health.remote())["healthy"]
                assert await seen(directory) == [first] and await seen(discovering) == [first]
                again = resizer.add("mixed")
                assert again == spare and spare not in directory.draining
                assert await seen(directory) == [first, spare]
            finally:
                await backend.close()

        asyncio.run(scenario())
    finally:
        pools.shutdown()
    with pytest.raises(ValueError):  # the pools' shutdown stopped it with the others
        ray.get_actor(spare, namespace=NAMESPACE)
