"""Pools on a local Ray started in this process: restart after kill -9, startup errors, bounded
directory answers. The tiny random model (no tokenizer needed by a worker) keeps it fast."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from pdserve.launcher.cluster.directory import RayDirectory  # noqa: E402
from pdserve.launcher.cluster.pools import ClusterPools, ClusterStartError, PoolSpec, actor_name, parse_actor_name  # noqa: E402
from pdserve.engine_args import ENGINE_DEFAULTS, engine_config  # noqa: E402

pytestmark = pytest.mark.timeout(120)
NAMESPACE = "pdserve-test-pools"


def tiny_engine(role: str, model: str = "random:tiny-llama"):
    return engine_config({**ENGINE_DEFAULTS, "model": model, "device": "cpu", "kv_cache_gib": 0.02}, role)


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", namespace=NAMESPACE, num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=80 * 1024 * 1024, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_actor_names_round_trip():
    assert actor_name("c1", "prefill", 3) == "pdserve:c1:prefill:3"
    assert parse_actor_name("pdserve:c1:prefill:3") == ("c1", "prefill", 3)
    assert parse_actor_name("other:c1:prefill:3") is None
    assert parse_actor_name("pdserve:c1:prefill") is None


def test_killed_worker_comes_back_on_a_new_address(local_ray):
    pools = ClusterPools("restart", NAMESPACE, [PoolSpec("mixed", 1, tiny_engine("mixed"), kv_backend="fake")])
    try:
        pools.start(60)
        health = pools.wait_ready(60)
        (name,) = pools.names
        assert name == "pdserve:restart:mixed:0"
        assert health[name]["healthy"] and health[name]["role"] == "mixed"

        directory = RayDirectory(NAMESPACE, "restart", pools.names, probe_timeout_s=1.0, refresh_interval_s=0)
        (before,) = asyncio.run(directory.endpoints())
        assert (before.worker_id, before.role, before.address) == (name, "mixed", health[name]["address"])
        os.kill(directory.last_info[name]["pid"], signal.SIGKILL)

        async def wait_for_restart() -> tuple[list, float]:
            seen_empty = False
            start = time.monotonic()
            while time.monotonic() - start < 60:
                t0 = time.monotonic()
                endpoints = await directory.endpoints()
                assert time.monotonic() - t0 < 3.0  # a dead or restarting actor never hangs the router
                if not endpoints:
                    seen_empty = True
                elif endpoints[0].address != before.address:
                    return endpoints, seen_empty
                await asyncio.sleep(0.2)
            raise AssertionError("the worker did not come back within 60s")

        (after,), seen_empty = asyncio.run(wait_for_restart())
        assert after.worker_id == name and after.role == "mixed"
        assert directory.last_info[name]["pid"] != health[name]["pid"]
        # Discovery by name prefix finds the same actor.
        found = asyncio.run(RayDirectory(NAMESPACE, "restart", None).endpoints())
        assert [e.address for e in found] == [after.address]
    finally:
        pools.shutdown()
    assert asyncio.run(RayDirectory(NAMESPACE, "restart", None).endpoints()) == []


def test_worker_that_fails_to_load_is_named(local_ray):
    pools = ClusterPools("broken", NAMESPACE, [PoolSpec("mixed", 1, tiny_engine("mixed", "random:no-such-shape"),
                                                         kv_backend="fake")])
    try:
        pools.start(30)
        with pytest.raises(ClusterStartError, match=r"worker pdserve:broken:mixed:0 failed to start: .*no-such-shape"):
            pools.wait_ready(30)
    finally:
        pools.shutdown()


def test_unplaceable_pool_is_named_with_its_resources(local_ray):
    spec = PoolSpec("prefill", 2, tiny_engine("prefill"), resources={"node_a": 1})
    pools = ClusterPools("nowhere", NAMESPACE, [spec])
    try:
        with pytest.raises(ClusterStartError, match=r"cannot place the prefill pool \(2 x \{'CPU': 1.0, 'node_a': 1\}"):
            pools.start(timeout_s=1.5)
    finally:
        pools.shutdown()
    deadline = time.monotonic() + 10  # the placement group is removed: its CPUs come back
    while ray.available_resources().get("CPU") != 4.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 4.0


def test_dead_actor_is_left_out_quickly(local_ray):
    directory = RayDirectory(NAMESPACE, "ghost", ["pdserve:ghost:decode:0"], probe_timeout_s=0.5, refresh_interval_s=0)
    t0 = time.monotonic()
    assert asyncio.run(directory.endpoints()) == []
    assert time.monotonic() - t0 < 2.0


def test_second_cluster_with_the_same_name_is_refused(local_ray):
    first = ClusterPools("dup", NAMESPACE, [PoolSpec("mixed", 1, tiny_engine("mixed"), kv_backend="fake")])
    second = ClusterPools("dup", NAMESPACE, [PoolSpec("mixed", 1, tiny_engine("mixed"), kv_backend="fake")])
    try:
        first.start(30)
        with pytest.raises(ClusterStartError, match=r"pdserve:dup:mixed:0 already exists .* --cluster-name"):
            second.start(30)
        assert second.names == []
        assert first.wait_ready(30)["pdserve:dup:mixed:0"]["healthy"]  # the first one is untouched
    finally:
        second.shutdown()
        first.shutdown()
