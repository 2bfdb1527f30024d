"""ClusterBackend with a network view, against fake gRPC workers: flows, samples, gauges, probes, 429."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from pdserve.sampling_params import SamplingParams
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.errors import Overloaded
from pdserve.router.metrics import RouterMetrics
from pdserve.router.cluster.network import NetworkOptions
from pdserve.router.placement.base import PlacementPolicy
from pdserve.router.placement.registry import make_policy
from pdserve.router.placement.policies.network_aware import NetworkAware
from pdserve.router.cluster.probes import ProbeSettings
from pdserve.router.placement.topology import Link, Topology
from tests.router.conftest import CharTokenizer
from tests.router.fake_workers import PREFILL_KV_BYTES_PER_TOKEN, Cluster, FakeWorker, MutableDirectory, Script
from tests.router.network_fixtures import PROFILE
from tests.router.test_cluster_backend import run, until

PROMPT = [10, 11, 12]
TOPOLOGY = Topology(links=(Link("na", "nb", 100.0, 0.0),), workers={"p0": "na", "d0": "nb"})


@contextlib.asynccontextmanager
async def env(policy: PlacementPolicy, p0: Script | None = None,
              network: NetworkOptions | None = None) -> AsyncIterator[tuple[ClusterBackend, RouterMetrics, dict]]:
    shared = Cluster()
    workers = {"p0": await FakeWorker("p0", "prefill", shared, p0).start(),
               "d0": await FakeWorker("d0", "decode", shared).start()}
    metrics = RouterMetrics()
    backend = ClusterBackend(MutableDirectory([x.endpoint for x in workers.values()]), policy, CharTokenizer(),
                             "fake-model", 4096, stats_interval_s=0.05, health_timeout_s=0.5, rpc_timeout_s=1.0,
                             kv_deadline_s=1.0, metrics=metrics, network=network)
    await backend.start()
    try:
        yield backend, metrics, workers
    finally:
        await backend.close()
        for x in workers.values():
            await x.stop()


def gauge(metrics: RouterMetrics, name: str, link: str = "na->nb") -> float | None:
    return metrics.registry.get_sample_value(name, {"link": link})


async def generate(backend: ClusterBackend, rid: str) -> list[int]:
    return [t async for o in backend.generate(rid, PROMPT, SamplingParams(max_tokens=3)) for t in o.new_token_ids]


def test_transfers_update_congestion_samples_and_gauges():
    async def main():
        policy = NetworkAware(profile=PROFILE, topology=TOPOLOGY)
        async with env(policy, Script(prefill_delay_s=0.3)) as (backend, metrics, _):
            assert backend.network.topology is TOPOLOGY  # taken from the policy
            assert backend.network.kv_bytes_per_token == PROFILE.kv_bytes_per_token  # the profile's, until measured
            task = asyncio.ensure_future(generate(backend, "r1"))
            await until(lambda: gauge(metrics, "pdserve:link_active_flows") == 1)
            assert gauge(metrics, "pdserve:link_bytes_in_flight") == 3 * PROFILE.kv_bytes_per_token
            assert backend.snapshot().links.state("na->nb").active_flows == 1
            assert backend.snapshot().worker("p0").num_inflight_tokens == 3
            assert len(await task) == 3
            state = backend.snapshot().links.state("na->nb")
            # p0 -> d0's first transfer paid for their connection: a lower bound, and no estimate yet
            assert (state.active_flows, state.bytes_in_flight, state.num_samples) == (0, 0, 0)
            assert state.measured_gbps is None and gauge(metrics, "pdserve:link_estimated_gbps") == 100.0
            assert len(await generate(backend, "r2")) == 3
            state = backend.snapshot().links.state("na->nb")
            assert (state.active_flows, state.bytes_in_flight, state.num_samples) == (0, 0, 1)
            # the fake reports 3 x 1000 bytes in 2 ms, after 1 ms of prefill: link-bound, 0.012 Gbit/s
            assert state.measured_gbps == pytest.approx(0.012)
            assert gauge(metrics, "pdserve:link_estimated_gbps") == pytest.approx(0.012)
            assert gauge(metrics, "pdserve:link_active_flows") == 0
            assert backend.network.kv_bytes_per_token == PREFILL_KV_BYTES_PER_TOKEN
            assert backend.snapshot().kv_bytes_per_token == PREFILL_KV_BYTES_PER_TOKEN
            assert backend.snapshot().worker("p0").num_inflight_tokens == 0
    run(main)


def test_baseline_policy_with_topology_keeps_gauges_and_failed_prefill_ends_its_flow():
    async def main():
        import grpc

        policy = make_policy("round-robin")
        network = NetworkOptions(topology=TOPOLOGY, kv_bytes_per_token=7)
        async with env(policy, Script(prefill_error=grpc.StatusCode.UNAVAILABLE), network) as (backend, metrics, ws):
            assert len(await generate(backend, "r1")) == 3  # P failed; re-placed locally on d0
            assert ws["p0"].called("Prefill") == ["r1"] and ws["d0"].called("Generate") == ["r1.1"]
            state = backend.snapshot().links.state("na->nb")
            assert (state.active_flows, state.num_samples) == (0, 0)
            assert gauge(metrics, "pdserve:link_estimated_gbps") == 100.0
    run(main)


@pytest.mark.parametrize("code, slowed", [("DEADLINE_EXCEEDED", True), ("DATA_LOSS", False)])
def test_a_kv_deadline_missed_lowers_the_links_estimate_a_corrupt_one_does_not(code, slowed):
    async def main():
        import grpc

        policy = make_policy("round-robin")
        network = NetworkOptions(topology=TOPOLOGY, kv_bytes_per_token=1000)
        script = Script(prefill_error=getattr(grpc.StatusCode, code))
        async with env(policy, script, network) as (backend, metrics, ws):
            assert len(await generate(backend, "r1")) == 3  # the KV failed: prefilled again on d0
            assert ws["d0"].called("Generate") == ["r1.1"]
            state = backend.snapshot().links.state("na->nb")
            if slowed:  # 3 tokens x 1000 bytes not landed within the 1 s deadline: under 24 kbit/s
                assert (state.num_samples, state.measured_gbps) == (1, pytest.approx(3 * 1000 * 8 / 1.0 / 1e9))
                assert gauge(metrics, "pdserve:link_estimated_gbps") == pytest.approx(2.4e-5)
            else:  # a damaged payload says nothing of the link's speed
                assert (state.num_samples, state.measured_gbps) == (0, None)
                assert gauge(metrics, "pdserve:link_estimated_gbps") == 100.0
    run(main)


def test_admission_control_maps_to_429():
    async def main():
        policy = NetworkAware(profile=PROFILE, topology=TOPOLOGY, slo_ttft=1e-6, admission_control=True)
        async with env(policy) as (backend, metrics, workers):
            with pytest.raises(Overloaded, match="cannot serve the request within its SLOs") as info:
                await generate(backend, "r1")
            assert info.value.status_code == 429
            assert workers["p0"].calls == [] and workers["d0"].calls == []
    run(main)


def test_probes_measure_each_link():
    async def main():
        network = NetworkOptions(probes=ProbeSettings(interval_s=60, num_tokens=8))
        async with env(make_policy("least-loaded"), network=network) as (backend, metrics, workers):
            key = "p0->d0"  # no topology: each worker is its own node
            await until(lambda: workers["d0"].called("Abort") == ["probe-1"])
            assert workers["p0"].called("Prefill") == ["probe-1"]
            assert workers["d0"].called("Reserve") == ["probe-1"]
            # the pair's first transfer paid for their connection: not an estimate yet
            assert backend.snapshot().links.state(key).num_samples == 0
            got = await backend.network.probe_links()
            assert got == {key: pytest.approx(0.032)}
            assert workers["p0"].called("Prefill") == ["probe-1", "probe-2"]
            assert backend.snapshot().links.state(key).num_samples == 1
            assert backend.snapshot().links.state(key).measured_gbps == pytest.approx(8 * 1000 * 8 / 0.002 / 1e9)
            assert backend.snapshot().links.state(key).active_flows == 0
    run(main)


def test_a_link_avoided_on_an_old_low_estimate_is_probed_again():
    async def main():
        policy = NetworkAware(profile=PROFILE, topology=TOPOLOGY)
        async with env(policy) as (backend, metrics, workers):
            net = backend.network
            assert net._reprobe_task is not None  # network-aware prices links: re-probes run
            assert len(await generate(backend, "r1")) == 3  # a flow over na->nb ended now
            now = time.monotonic()
            assert net.stale_links(now + 3600) == []  # no estimate yet (the first transfer is a bound)
            net.links.record("na->nb", 1e-6)  # one very slow sample: the policy would avoid the link
            assert net.stale_links(now) == []  # a transfer crossed it just now
            assert net.stale_links(now + 59) == [] and net.stale_links(now + 61) == ["na->nb"]
            key, gbps = await net.reprobe_stale(now + 61)
            assert key == "na->nb" and gbps is not None and gbps > 1e-6
            probes = [c for c in workers["p0"].called("Prefill") if c.startswith("probe-")]
            assert probes == ["probe-1"] and workers["d0"].called("Abort")[-1] == "probe-1"
            assert net.links.state("na->nb").measured_gbps > 1e-6  # raised by the probe's sample
            assert net.stale_links(time.monotonic() + 59) == []  # the probe's flow counts as a crossing
            net.links.record("na->nb", 1e9)  # at (above) its capacity: not avoided, never due
            assert net.stale_links(time.monotonic() + 3600) == []
        async with env(make_policy("round-robin")) as (backend, _, _):
            assert backend.network._reprobe_task is None  # estimates place nothing: no re-probes
    run(main)


def test_reprobe_setting_is_checked():
    with pytest.raises(ValueError, match="reprobe_after_s"):
        NetworkOptions(reprobe_after_s=0)
    assert NetworkOptions(reprobe_after_s=None).reprobe_after_s is None
