"""In a simulation, network-aware's columnar path makes every decision its general path makes
(sim.check runs both on each placement and feeds both every outcome, so calibration is live)."""

from __future__ import annotations

import random

import pytest

from router.placement.topology import Link, Topology
from sim.check import CheckedNetworkAware, checked_policy
from sim.config import ClusterConfig, EngineLimits, RouterConfig, WorkerConfig
from sim.profiles import llama8b_h100
from sim.run import Arrival, simulate


def cluster(options: dict) -> ClusterConfig:
    """128 workers (32 prefill), 8 a node, 4 nodes a rack: 100 Gbit/s in a rack, 25 across."""
    nodes = [f"n{i:02d}" for i in range(16)]
    workers = tuple(WorkerConfig(f"{'p' if i % 4 == 0 else 'd'}{i:03d}", "prefill" if i % 4 == 0 else "decode",
                                 nodes[i // 8]) for i in range(128))
    links = tuple(Link(a, b, 100.0, 0.005) for a in nodes for b in nodes
                  if a != b and int(a[1:]) // 4 == int(b[1:]) // 4)
    return ClusterConfig(profile=llama8b_h100(), workers=workers,
                         topology=Topology(links=links, remote_gbps=25.0, remote_latency_ms=0.01),
                         engine=EngineLimits(num_blocks=2048, block_size=16, max_num_batched_tokens=8192,
                                             max_num_seqs=64),
                         router=RouterConfig(stats_interval_s=0.05, rpc_s=0.0002,
                                             policy_options={"network-aware": options}))


@pytest.mark.parametrize("options", [{}, {"slo_tpot": 0.0075, "slo_ttft": 0.05}])
def test_simulated_run_same_decisions(options):
    rng = random.Random(11)
    t, arrivals = 0.0, []
    for _ in range(700):
        t += rng.expovariate(900.0)
        arrivals.append(Arrival(t, int(min(8000, rng.lognormvariate(6.4, 1.0))) + 1, rng.choice([1, 32, 128, 400])))
    config = cluster(options)
    policy = checked_policy(config)
    assert isinstance(policy, CheckedNetworkAware)
    run = simulate(config, policy, arrivals, record_tokens=False)
    assert policy.checked >= len(arrivals)  # retries place again
    assert sum(r.error is None for r in run.requests) > 600
    assert policy.calibration.describe()  # the model was calibrated during the run
