"""In a simulation, network-aware's search makes every decision its oracle (every option priced)
makes (sim.check runs both on each placement and feeds both every outcome, so calibration is live)."""

from __future__ import annotations

import random

import pytest

from pdserve.router.placement.topology import Link, Topology
from pdserve.sim.check import CheckedNetworkAware, checked_policy
from pdserve.sim.config import ClusterConfig, EngineLimits, RouterConfig, WorkerConfig
from pdserve.sim.profiles import llama8b_h100
from pdserve.sim.run import Arrival, simulate


def cluster(options: dict) -> ClusterConfig:
    """48 workers (12 prefill, 4 mixed), 4 a node, 4 nodes a rack: 100 Gbit/s in a rack, 25 across."""
    nodes = [f"n{i:02d}" for i in range(12)]
    roles = ["prefill" if i % 4 == 0 else "mixed" if i % 12 == 1 else "decode" for i in range(48)]
    workers = tuple(WorkerConfig(f"{role[0]}{i:03d}", role, nodes[i // 4]) for i, role in enumerate(roles))
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
    for _ in range(400):
        t += rng.expovariate(350.0)
        arrivals.append(Arrival(t, int(min(8000, rng.lognormvariate(6.4, 1.0))) + 1, rng.choice([1, 32, 128, 400])))
    config = cluster(options)
    policy = checked_policy(config)
    assert isinstance(policy, CheckedNetworkAware)
    run = simulate(config, policy, arrivals, record_tokens=False)
    assert policy.checked >= len(arrivals)  # retries place again
    assert sum(r.error is None for r in run.requests) > 340
    assert policy.calibration.describe()  # the model was calibrated during the run
