"""Network-aware placement speed: placements per second at 16, 256 and 1,000 workers.

    PYTHONPATH=. python benchmarks/bench_placement.py [--workers 16 256 1000] [--out FILE]

Clusters are laid out as the simulator's scale runs lay them out (benchmarks/bench_sim.py):
8 workers a node, 4 nodes a rack, a quarter of the workers prefill; 100 Gbit/s links inside a
rack (explicit topology entries), 25 Gbit/s across (the remote default); the 8B-sized H100
profile of sim/profiles.py. Each cluster is timed in two states:

- idle: every worker empty, no flow on any link (every option ties with its neighbours: the
  worst case for a search that must break ties by load and worker id as the policy does);
- loaded: a seeded random state: prefill queues of 0-6 prompts, decode batches of 0-128
  requests with their context, a tenth of the decode workers without free blocks, flows on a
  third of the in-rack links and on cross-rack links, measured rates below capacity.

Requests have lognormal prompt lengths (mean about 1,024 tokens) and 128 new tokens; a TPOT
SLO of 20 ms makes some decode workers infeasible. "exhaustive" prices every (P, D) pair (the
policy's code before the pruned search; still its path for small clusters); "pruned" is the
policy as it runs now. Every exhaustive decision is compared with the pruned one on the same
snapshot and request: the script fails if any differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from router.congestion import CongestionView, LinkState
from router.placement import ClusterSnapshot, RequestInfo, WorkerSnapshot
from router.policies import NetworkAware
from router.topology import Link, Topology, link_key
from sim.profiles import llama8b_h100

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
                links[link.key] = LinkState(active_flows=int(rng.integers(1, 5)), measured_gbps=float(rng.uniform(60, 100)),
                                            num_samples=3)
        for _ in range(len(nodes) * 2):
            a, b = rng.choice(nodes, 2, replace=False)
            links[link_key(str(a), str(b))] = LinkState(active_flows=int(rng.integers(1, 4)),
                                                        measured_gbps=float(rng.uniform(15, 25)), num_samples=2)
    return ClusterSnapshot(tuple(snaps), topology=topology, links=CongestionView(links))


def requests(count: int, seed: int) -> list[RequestInfo]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(1024) - 0.5, 1.0, count), 16, 8192).astype(int)
    return [RequestInfo(request_id=f"r{i}", num_prompt_tokens=int(n), max_tokens=128) for i, n in enumerate(lengths)]


def policy(exhaustive: bool) -> NetworkAware:
    p = NetworkAware(profile=llama8b_h100(), slo_tpot=0.02)
    if exhaustive:
        p.exhaustive_max_pairs = 1 << 62
    return p


def timed(p: NetworkAware, snap: ClusterSnapshot, reqs: list[RequestInfo], budget_s: float):
    decisions, start = [], time.perf_counter()
    for r in reqs:
        decisions.append(p.place(r, snap))
        if time.perf_counter() - start > budget_s:
            break
    elapsed = time.perf_counter() - start
    return decisions, len(decisions) / elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 256, 1000])
    ap.add_argument("--requests", type=int, default=200, help="requests per state (the pruned search places all)")
    ap.add_argument("--exhaustive-budget-s", type=float, default=30.0,
                    help="seconds of exhaustive placements per state (at least one is made)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    rows = []
    for n in args.workers:
        workers, topology = layout(n)
        for state in ("idle", "loaded"):
            snap = snapshot(workers, topology, state == "loaded", seed=n)
            reqs = requests(args.requests, seed=n + 1)
            # the prefix index records each decision: fresh policies, same request order, for both
            old, old_rate = timed(policy(True), snap, reqs, args.exhaustive_budget_s)
            new, new_rate = timed(policy(False), snap, reqs, float("inf"))
            same = all(a == b for a, b in zip(old, new))
            row = {"workers": n, "state": state, "pairs": sum(r == "prefill" for _, r, _ in workers)
                   * sum(r == "decode" for _, r, _ in workers), "exhaustive_placements_per_s": round(old_rate, 2),
                   "pruned_placements_per_s": round(new_rate, 1), "speedup": round(new_rate / old_rate, 1),
                   "compared": len(old), "identical": same,
                   "kinds": {k: sum(d.kind == k for d in new) for k in ("disaggregated", "local")}}
            rows.append(row)
            print(f"{n:5d} workers {state:6s}: exhaustive {old_rate:9.2f}/s ({len(old)} placed), "
                  f"pruned {new_rate:9.1f}/s, x{new_rate / old_rate:.1f}, identical on {len(old)}: {same}", flush=True)
            if not same:
                bad = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
                print(f"  first difference, request {bad}:\n  exhaustive {old[bad]}\n  pruned     {new[bad]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
            f.write("\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
