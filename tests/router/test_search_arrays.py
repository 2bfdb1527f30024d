"""Network-aware's search on arrays decides exactly as pricing every option (its oracle).

The profile queries on arrays against the scalar ones (bit for bit), then seeded random clusters
(mixed workers among them): sequences of requests (shared prefixes, excluded
workers, unhealthy and full workers, flows and measured rates, SLOs, admission control,
calibration factors), each placed by a policy on each path, decisions and refusals compared;
snapshots that change a few workers at a time exercise the arrays kept across placements.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from pdserve.router.placement.congestion import CongestionView, LinkState
from pdserve.router.placement.base import (ClusterSnapshot, NoWorkersAvailable, RequestInfo, SLOUnattainable,
                                           WorkerSnapshot)
from pdserve.router.placement.policies.network_aware import NetworkAware
from pdserve.router.placement.policies.calibration import Factors
from pdserve.router.placement.policies.oracle import OracleNetworkAware
from pdserve.router.placement.policies.columns import decode_steps, prefill_times
from pdserve.router.placement.profiles import Profile
from pdserve.router.placement.topology import Link, Topology
from pdserve.sim.profiles import llama8b_h100, llama70b_h100_tp4
from tests.router.network_fixtures import PROFILE


def random_profile(rng: random.Random) -> Profile:
    def axis(n: int, top: int) -> tuple[int, ...]:
        return tuple(sorted(rng.sample(range(1, top), n)))

    batches, contexts = axis(rng.randint(1, 5), 300), axis(rng.randint(1, 5), 20000)
    tokens = axis(rng.randint(1, 4), 9000)
    return Profile(
        hardware="test", device="cpu", model="m", dtype="bfloat16", num_layers=rng.choice([2, 32, 80]),
        kv_bytes_per_token=rng.choice([65536, 131072]), block_size=16, max_num_batched_tokens=rng.choice([512, 8192]),
        prefill_tokens=tokens, prefill_times=tuple(rng.uniform(0.001, 0.5) for _ in tokens),
        decode_batch_sizes=batches, decode_contexts=contexts,
        decode_times=tuple(tuple(rng.uniform(0.001, 0.1) for _ in contexts) for _ in batches),  # not monotone
    )


@pytest.mark.parametrize("seed", range(40))
def test_profile_queries_on_arrays_are_the_scalar_ones(seed):
    rng = random.Random(seed)
    profile = [PROFILE, llama8b_h100(), llama70b_h100_tp4()][seed] if seed < 3 else random_profile(rng)
    gen = np.random.default_rng(seed)
    batch = np.r_[gen.integers(-2, 600, 3000), np.array(profile.decode_batch_sizes), 0, 1]
    context = np.r_[gen.integers(-5, 50000, 3000), np.array(profile.decode_batch_sizes) * 0 + 1, 0, 128]
    admit, tpot = decode_steps(profile, batch, context, batch + 1)
    assert admit.tolist() == [profile.decode_step_seconds(b, c) for b, c in zip(batch.tolist(), context.tolist())]
    assert tpot.tolist() == [profile.decode_step_seconds(b + 1, c) for b, c in zip(batch.tolist(), context.tolist())]
    assert decode_steps(profile, batch, context).tolist() == admit.tolist()
    tokens = np.r_[gen.integers(-3, 30000, 3000), np.array(profile.prefill_tokens), 0, 1]
    assert prefill_times(profile, tokens).tolist() == [profile.prefill_seconds(t) for t in tokens.tolist()]


# ---------------------------------------------------------------- random large clusters


def large_cluster(rng: random.Random) -> tuple[list[WorkerSnapshot], Topology, dict[str, LinkState]]:
    """Nodes in racks, explicit in-rack links (sometimes a node's own),
    loads with exact ties, some workers unhealthy, full, or too small for long prompts."""
    nodes = [f"n{i:02d}" for i in range(rng.randint(4, 16))]
    rack = {n: i // rng.choice([2, 4]) for i, n in enumerate(nodes)}
    links = [Link(a, b, rng.choice([100.0, 100.0, 50.0]), rng.choice([0.0, 0.005])) for a in nodes for b in nodes
             if a != b and rack[a] == rack[b]]
    if rng.random() < 0.3:
        links.append(Link(nodes[0], nodes[0], 400.0, 0.0))
    topo = Topology(links=tuple(links), local_gbps=rng.choice([100.0, 200.0]),
                    local_latency_ms=rng.choice([0.0, 0.005]),
                    remote_gbps=rng.choice([10.0, 25.0]), remote_latency_ms=rng.choice([0.0, 0.01]))
    workers = []
    for i in range(rng.randint(20, 60)):
        role = "prefill" if rng.random() < 0.3 else ("mixed" if rng.random() < 0.1 else "decode")
        kw: dict = {}
        if rng.random() < 0.7:
            n = rng.choice([0, 1, 1, 2, 3, 8, 40])
            kw = dict(num_running=n, num_inflight=rng.choice([0, n, n + 1]),
                      num_inflight_tokens=rng.choice([0, 300, 512, 4096]) * n, num_waiting=rng.choice([0, 0, 1]))
        if rng.random() < 0.5:
            kw.update(num_blocks=rng.choice([64, 512, 512, 512]), block_size=16,
                      num_free_blocks=rng.choice([0, 8, 64, 300, 512]))
        if rng.random() < 0.05:
            kw["healthy"] = False
        if rng.random() < 0.05:
            kw["max_model_len"] = 2048
        worker_id = f"{role[0]}{rng.randrange(10**6):06d}"
        workers.append(WorkerSnapshot(worker_id=worker_id, role=role,  # type: ignore[arg-type]
                                      node=rng.choice(nodes), **kw))
    states = {}
    for _ in range(rng.randint(0, 12)):
        a, b = rng.choice(nodes), rng.choice(nodes)
        states[f"{a}->{b}"] = LinkState(active_flows=rng.choice([0, 0, 1, 2]),
                                        measured_gbps=rng.choice([None, 5.0, 25.0, 60.0, 300.0]))
    return workers, topo, states


def placements(policy: NetworkAware, requests, snapshots):
    found = []
    for request, snap in zip(requests, snapshots):
        try:
            found.append(policy.place(request, snap))
        except (SLOUnattainable, NoWorkersAvailable) as exc:
            found.append(f"{type(exc).__name__}: {exc}")
    return found


@pytest.mark.parametrize("seed", range(60))
def test_random_large_clusters_same_decisions(seed):
    rng = random.Random(7000 + seed)
    workers, topo, states = large_cluster(rng)
    options = rng.choice([{}, {"slo_tpot": 0.02}, {"slo_tpot": 0.011}, {"slo_ttft": 0.3, "slo_tpot": 0.02},
                          {"slo_ttft": 0.3, "slo_tpot": 0.02, "admission_control": True}, {"local_margin": 0.0}])
    profile = rng.choice([PROFILE, llama8b_h100()])
    prefixes = [tuple(rng.randrange(100) for _ in range(64)) for _ in range(3)]
    requests, snapshots = [], []
    for i in range(16):
        # a few workers change between placements (new objects), the rest are the same objects
        for _ in range(rng.choice([0, 1, 3])):
            k = rng.randrange(len(workers))
            n = rng.choice([0, 1, 2, 5])
            workers[k] = dataclasses.replace(workers[k], num_running=n, num_inflight=n,
                                             num_inflight_tokens=rng.choice([0, 700]) * n)
        if rng.random() < 0.1:  # a worker moves to another node, or is replaced by a new one
            k = rng.randrange(len(workers))
            workers[k] = dataclasses.replace(workers[k], node=rng.choice(sorted({w.node for w in workers})))
        if rng.random() < 0.1:
            k = rng.randrange(len(workers))
            workers[k] = dataclasses.replace(workers[k], worker_id=f"x{i:02d}", role=rng.choice(["prefill", "decode"]))
        if rng.random() < 0.1:  # a snapshot of new objects throughout
            workers = [dataclasses.replace(w) for w in workers]
        if rng.random() < 0.3 and states:
            key = rng.choice(sorted(states))
            states[key] = LinkState(active_flows=rng.choice([0, 1, 3]), measured_gbps=rng.choice([None, 8.0]))
        ids = rng.choice(prefixes)[:rng.choice([0, 16, 48, 64])] + tuple(range(rng.randint(1, 3000)))
        excluded = frozenset(rng.sample([w.worker_id for w in workers], 2)) if rng.random() < 0.2 else frozenset()
        requests.append(RequestInfo(request_id=f"r{i}", num_prompt_tokens=len(ids), max_tokens=rng.choice([1, 64, 512]),
                                    prompt_token_ids=ids if rng.random() < 0.7 else (), excluded=excluded))
        snapshots.append(ClusterSnapshot(tuple(workers), topology=topo, links=CongestionView(dict(states)),
                                         kv_bytes_per_token=rng.choice([0, 65536]), now=float(i)))
    policies = [NetworkAware(profile=profile, **options), OracleNetworkAware(profile=profile, **options)]
    if rng.random() < 0.5:  # calibrated: residual factors as learned from outcomes
        factors = {"local": Factors(ttft=rng.uniform(0.8, 1.5), tpot=rng.uniform(0.8, 1.5)),
                   "disaggregated": Factors(ttft=rng.uniform(0.8, 1.5), tpot=rng.choice([1.0, 1.3]))}
        prefill = rng.choice([1.0, 1.6])
        for policy in policies:
            policy.calibration.estimate_factors = factors.__getitem__  # type: ignore[method-assign]
            policy.calibration.factor = lambda q: prefill if q == "prefill" else 1.0  # type: ignore[method-assign]
    fast, oracle = (placements(p, requests, snapshots) for p in policies)
    assert fast == oracle


def test_a_count_that_is_not_an_integer_is_refused():
    rng = random.Random(3)
    workers, topo, _ = large_cluster(rng)
    policy = NetworkAware(profile=PROFILE)
    request = RequestInfo(request_id="r", num_prompt_tokens=1000, max_tokens=16)
    odd = ClusterSnapshot((dataclasses.replace(workers[0], num_free_blocks=1.5), *workers[1:]), topology=topo)
    with pytest.raises(ValueError, match=f"worker '{workers[0].worker_id}': num_free_blocks must be an integer"):
        policy.place(request, odd)
    policy.place(request, ClusterSnapshot(tuple(workers), topology=topo))  # the next snapshot is read afresh
