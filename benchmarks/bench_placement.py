"""Network-aware placement speed: placements per second at 16, 256 and 1,000 workers.

    python -m benchmarks.bench_placement [--workers 4 16 64 256 1000] [--out FILE]

Clusters are laid out as the simulator's scale runs lay them out (benchmarks/bench_sim.py):
8 workers a node, 4 nodes a rack, a quarter of the workers prefill; 100 Gbit/s links inside a
rack (explicit topology entries), 25 Gbit/s across (the remote default); the 8B-sized H100
profile of pdserve/sim/profiles.py. Each cluster is timed in two states:

- idle: every worker empty, no flow on any link (every option ties with its neighbours: the
  worst case for a search that must break ties by load and worker id as the policy does);
- loaded: a seeded random state: prefill queues of 0-6 prompts, decode batches of 0-128
  requests with their context, a tenth of the decode workers without free blocks, flows on a
  third of the in-rack links and on cross-rack links, measured rates below capacity.

Requests have lognormal prompt lengths (mean about 1,024 tokens) and 128 new tokens; a TPOT
SLO of 20 ms makes some decode workers infeasible. Two code paths: "search" is the policy
(router.placement.policies.search, at every size); "exhaustive" is its oracle, pricing every
option (router.placement.policies.oracle), within `--exhaustive-budget-s`. Every decision of the
oracle is compared with the search's on the same snapshot and request: the script fails if
any differs.

Two more states at the sizes of `--sim-workers` (default 1,000), closer to a router's work:

- loaded-new: the loaded state with every `WorkerSnapshot` a new object at each request (a
  router that rebuilds its snapshot from scratch: the search reads every worker again);
- sim: `--sim-requests` placements recorded from a simulated run (benchmarks/bench_sim.py's
  cluster and trace, 4,000 req/s) after `--sim-warmup` requests, with the policy's state
  (calibration, prefix index) as it was there: consecutive snapshots share the workers that
  did not change, as the simulator's (and a router's cached) snapshots do. No exhaustive run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time

import numpy as np

from pdserve.router.placement.congestion import CongestionView, LinkState
from pdserve.router.placement.base import ClusterSnapshot, RequestInfo, WorkerSnapshot
from pdserve.router.placement.policies.network_aware import NetworkAware
from pdserve.router.placement.policies.oracle import OracleNetworkAware
from pdserve.router.placement.topology import Link, Topology, link_key
from pdserve.sim.profiles import llama8b_h100

PER_NODE = 8
NODES_PER_RACK = 4


def layout(num_workers: int) -> tuple[list[tuple[str, str, str]], Topology]:
    """[(worker id, role, node)] and the two-tier topology (bench_sim.two_tier_cluster's layout)."""
    num_prefill = max(1, round(num_workers / 4))
    num_nodes = -(-num_workers // PER_NODE)
    nodes = [f"n{i:04d}" for i in range(num_nodes)]
    rack = {n: i // NODES_PER_RACK for i, n in enumerate(nodes)}
    stride = num_workers / num_prefill
    prefill_slots = {int(k * stride) for k in range(num_prefill)}
    workers, np_, nd_ = [], 0, 0
    for i in range(num_workers):
        node = nodes[i // PER_NODE]
        if i in prefill_slots:
            workers.append((f"p{np_:04d}", "prefill", node))
            np_ += 1
        else:
            workers.append((f"d{nd_:04d}", "decode", node))
            nd_ += 1
    links = tuple(Link(a, b, 100.0, 0.005) for a in nodes for b in nodes if a != b and rack[a] == rack[b])
    return workers, Topology(links=links, remote_gbps=25.0, remote_latency_ms=0.010)


def snapshot(workers: list[tuple[str, str, str]], topology: Topology, loaded: bool, seed: int) -> ClusterSnapshot:
    rng = np.random.default_rng(seed)
    snaps, links = [], {}
    for worker_id, role, node in workers:
        kw: dict = {"num_blocks": 16384, "block_size": 16, "num_free_blocks": 16384}
        if loaded and role == "prefill":
            n = int(rng.integers(0, 7))
            kw.update(num_inflight=n, num_running=min(n, 1), num_waiting=max(0, n - 1),
                      num_inflight_tokens=int(rng.integers(200, 2000)) * n)
        elif loaded:
            n = int(rng.integers(0, 129))
            context = int(rng.integers(300, 3000))
            free = 0 if rng.random() < 0.1 else max(0, 16384 - n * context // 16)
            kw.update(num_inflight=n, num_running=n, num_inflight_tokens=n * context, num_free_blocks=free)
        snaps.append(WorkerSnapshot(worker_id=worker_id, role=role, node=node, **kw))  # type: ignore[arg-type]
    if loaded:
        nodes = sorted({node for _, _, node in workers})
        for link in topology.links:
            if rng.random() < 1 / 3:
                links[link.key] = LinkState(active_flows=int(rng.integers(1, 5)),
                                            measured_gbps=float(rng.uniform(60, 100)), num_samples=3)
        for _ in range(len(nodes) * 2 if len(nodes) > 1 else 0):  # cross-node flows need two nodes
            a, b = rng.choice(nodes, 2, replace=False)
            links[link_key(str(a), str(b))] = LinkState(active_flows=int(rng.integers(1, 4)),
                                                        measured_gbps=float(rng.uniform(15, 25)), num_samples=2)
    return ClusterSnapshot(tuple(snaps), topology=topology, links=CongestionView(links))


def requests(count: int, seed: int) -> list[RequestInfo]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(1024) - 0.5, 1.0, count), 16, 8192).astype(int)
    return [RequestInfo(request_id=f"r{i}", num_prompt_tokens=int(n), max_tokens=128) for i, n in enumerate(lengths)]


def policy(path: str) -> NetworkAware:
    return (OracleNetworkAware if path == "exhaustive" else NetworkAware)(profile=llama8b_h100(), slo_tpot=0.02)


def renewed(snap: ClusterSnapshot) -> ClusterSnapshot:
    """The same snapshot with every worker a new object."""
    return dataclasses.replace(snap, workers=tuple(dataclasses.replace(w) for w in snap.workers))


def clone(p: NetworkAware) -> NetworkAware:
    """A copy of the policy's state; the immutable topology and profile shared."""
    return copy.deepcopy(p, {id(p.topology): p.topology, id(p.profile): p.profile})


def recorded(num_workers: int, warmup: int, count: int):
    """(policy as it was, [(request, snapshot)]) from a simulated run (module docstring)."""
    from benchmarks.bench_sim import two_tier_cluster, write_azure_trace
    from pathlib import Path
    from pdserve.sim.run import simulate
    from pdserve.sim.workload import trace_arrivals

    total = warmup + count
    trace = Path("results/sim-traces") / f"azure-synthetic-{total}-4000.csv"
    if not trace.exists():
        trace.parent.mkdir(parents=True, exist_ok=True)
        write_azure_trace(trace, total, 4000.0)
    config = two_tier_cluster(num_workers)
    saved: list = []
    calls: list = []

    class Recording(NetworkAware):
        def place(self, request, snapshot):
            if len(calls) == warmup:
                saved.append(clone(self))
                saved[0].__class__ = NetworkAware  # replays place as the policy itself
            if warmup <= len(calls) < total:
                calls.append((request, snapshot))
            else:
                calls.append(None)
            return super().place(request, snapshot)

    simulate(config, Recording(profile=config.profile, topology=config.topology),
             trace_arrivals(str(trace), max_requests=total), record_tokens=False, keep=False)
    return saved[0], [c for c in calls if c is not None]


def replay(p: NetworkAware, pairs, budget_s: float):
    decisions, start = [], time.perf_counter()
    for request, snap in pairs:
        decisions.append(p.place(request, snap))
        if time.perf_counter() - start > budget_s:
            break
    elapsed = time.perf_counter() - start
    return decisions, len(decisions) / elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 16, 64, 256, 1000])
    ap.add_argument("--requests", type=int, default=200, help="requests per state (the search places all)")
    ap.add_argument("--exhaustive-budget-s", type=float, default=30.0,
                    help="seconds of exhaustive placements per state (at least one is made; 0: none)")
    ap.add_argument("--sim-workers", type=int, nargs="*", default=[1000],
                    help="sizes for the loaded-new and sim states (none: skip them)")
    ap.add_argument("--sim-warmup", type=int, default=3000)
    ap.add_argument("--sim-requests", type=int, default=1000)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    rows = []

    def report(n: int, state: str, pairs: int, results: dict[str, tuple[list, float]]) -> None:
        reference = results["search"][0]
        identical = {path: all(a == b for a, b in zip(found, reference)) and len(found) <= len(reference)
                     for path, (found, _) in results.items()}
        row = {"workers": n, "state": state, "pairs": pairs,
               **{f"{path}_placements_per_s": round(rate, 2) for path, (_, rate) in results.items()},
               **{f"{path}_compared": len(found) for path, (found, _) in results.items()},
               "identical": all(identical.values()),
               "kinds": {k: sum(d.kind == k for d in results["search"][0]) for k in ("disaggregated", "local")}}
        rows.append(row)
        rates = ", ".join(f"{path} {rate:9.1f}/s ({len(found)} placed)" for path, (found, rate) in results.items())
        print(f"{n:5d} workers {state:10s}: {rates}; identical: {row['identical']}", flush=True)
        for path, same in identical.items():
            if not same:
                found = results[path][0]
                bad = next(i for i, (a, b) in enumerate(zip(found, reference)) if a != b)
                print(f"  first difference, request {bad}:\n  {path} {found[bad]}\n  search {reference[bad]}")

    for n in args.workers:
        workers, topology = layout(n)
        pairs = sum(r == "prefill" for _, r, _ in workers) * sum(r == "decode" for _, r, _ in workers)
        states = ["idle", "loaded"] + (["loaded-new"] if n in args.sim_workers else [])
        for state in states:
            snap = snapshot(workers, topology, state != "idle", seed=n)
            reqs = requests(args.requests, seed=n + 1)
            snaps = [renewed(snap) for _ in reqs] if state == "loaded-new" else [snap] * len(reqs)
            # the prefix index records each decision: fresh policies, same request order, for all
            results = {}
            if args.exhaustive_budget_s > 0 and state != "loaded-new":
                results["exhaustive"] = replay(policy("exhaustive"), zip(reqs, snaps), args.exhaustive_budget_s)
            results["search"] = replay(policy("search"), zip(reqs, snaps), float("inf"))
            report(n, state, pairs, results)
    for n in args.sim_workers:
        state, calls = recorded(n, args.sim_warmup, args.sim_requests)
        workers, _ = layout(n)
        pairs = sum(r == "prefill" for _, r, _ in workers) * sum(r == "decode" for _, r, _ in workers)
        results = {"search": replay(clone(state), calls, float("inf"))}
        report(n, "sim", pairs, results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
            f.write("\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
