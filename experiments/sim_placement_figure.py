"""Network-aware vs least-loaded vs round-robin goodput on a two-tier topology (simulated).

    .venv/bin/python -m experiments.sim_placement_figure     # ~10 minutes on 2 cores

32 GPUs (workers), 4 to a node, 4 nodes to a rack, 2 racks: 200 Gbit/s within a node (the
topology's local default), 100 Gbit/s between nodes of a rack, 25 Gbit/s across racks (each
node pair its own link, as router.placement.topology models it: no shared rack uplink). Axes:
- prefill:decode ratio: 4:28, 8:24, 16:16;
- layout: the share of prefill workers packed into rack 0 (0: spread evenly over the
  racks; 1: all packed), reported as the cross-rack share of P->D pairs (what a placement
  that ignores the network sends across racks);
- policy: round-robin, least-loaded, network-aware, and network-aware restricted to (P, D)
  pairs (`local_margin` 0.99: no local prefill on decode workers), which separates what it
  gains by keeping KV off slow links from what it gains by prefilling on idle decode workers;
- model: Llama-3.1-8B- and 70B-sized KV and step times (pdserve/sim/profiles.py: derived from the
  H100 figures, the 70B one scaled; labelled so, not profiled).
Workload: Poisson arrivals, prompts lognormal mean 1,024 (max 8,192), outputs mean 128 (max
1,024), 1,000 requests per run, at 70%, 90% and 120% of the prefill pool's capacity for that
workload (from the profile; above 100% only local prefill on decode workers can keep up); goodput =
requests meeting TTFT <= 0.15 s and TPOT <= 0.04 s (8B; 70B: 0.5 s and 0.08 s) per second of
arrivals (first to last send: a run's output tail does not dilute it); the figure takes each
policy's best over the three rates.
Writes results/sim-placement/: figure.csv (every run), figure.png, figure.md.
"""

from __future__ import annotations

import csv
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from pdserve.loadgen.metrics import SLO, summarize
from pdserve.router.placement.topology import Link, Topology
from pdserve.sim.config import ClusterConfig, EngineLimits, RouterConfig, WorkerConfig
from pdserve.sim.profiles import llama8b_h100, llama70b_h100_tp4
from pdserve.sim.run import Arrival, simulate, to_record

OUT = Path(__file__).resolve().parents[1] / "results" / "sim-placement"
POLICIES = ("round-robin", "least-loaded", "network-aware", "network-aware, pairs only")
NO_LOCAL = {"network-aware": {"local_margin": 0.99}}  # local prefill on D only when 100x faster: never here
RATIOS = ((4, 28), (8, 24), (16, 16))
PACKED = (0.0, 0.5, 1.0)
LOADS = (0.7, 0.9, 1.2)
MODELS = {"8B": (llama8b_h100, SLO(0.15, 0.04)), "70B": (llama70b_h100_tp4, SLO(0.5, 0.08))}
NUM_REQUESTS = 1000
PER_NODE, NODES_PER_RACK, RACKS = 4, 4, 2


def layout(num_prefill: int, packed: float) -> list[str]:
    """Roles of the 32 slots (rack by rack, node by node): round(packed x P) prefill workers
    fill rack 0 from its first slot, the rest are spread evenly over the remaining slots."""
    slots = PER_NODE * NODES_PER_RACK * RACKS
    n_packed = round(packed * num_prefill)
    roles = ["decode"] * slots
    for i in range(n_packed):
        roles[i] = "prefill"
    rest = [i for i in range(n_packed, slots)]
    spread = num_prefill - n_packed
    for k in range(spread):
        roles[rest[int(k * len(rest) / spread)]] = "prefill"
    return roles


def cluster(num_prefill: int, packed: float, profile) -> tuple[ClusterConfig, float]:
    roles = layout(num_prefill, packed)
    nodes = [f"r{i // (PER_NODE * NODES_PER_RACK)}n{(i // PER_NODE) % NODES_PER_RACK}" for i in range(len(roles))]
    names = sorted(set(nodes))
    rack = {n: n.split("n")[0] for n in names}
    links = tuple(Link(a, b, 100.0, 0.005) for a in names for b in names if a != b and rack[a] == rack[b])
    topology = Topology(links=links, remote_gbps=25.0, remote_latency_ms=0.010, local_gbps=200.0)
    counts = {"prefill": 0, "decode": 0}
    workers = []
    for role, node in zip(roles, nodes):
        workers.append(WorkerConfig(f"{role[0]}{counts[role]:02d}", role, node))
        counts[role] += 1
    p = [w for w in workers if w.role == "prefill"]
    d = [w for w in workers if w.role == "decode"]
    cross = sum(rack[a.node] != rack[b.node] for a in p for b in d) / (len(p) * len(d))
    config = ClusterConfig(profile=profile, workers=tuple(workers), topology=topology,
                           engine=EngineLimits(num_blocks=16384, block_size=16, max_num_batched_tokens=8192,
                                               max_num_seqs=128),
                           router=RouterConfig(stats_interval_s=0.1))
    return config, cross


def workload(rate: float, seed: int = 0) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    offsets = np.cumsum(rng.exponential(1 / rate, NUM_REQUESTS))
    n_in = np.clip(rng.lognormal(np.log(1024) - 0.5, 1.0, NUM_REQUESTS), 16, 8192).astype(int)
    n_out = np.clip(rng.lognormal(np.log(128) - 0.32, 0.8, NUM_REQUESTS), 2, 1024).astype(int)
    return [Arrival(float(o), int(i), int(n)) for o, i, n in zip(offsets, n_in, n_out)]


def prefill_capacity(profile, num_prefill: int) -> float:
    """Requests/s the prefill pool computes back to back, for this workload's prompt mix."""
    sample = workload(1.0, seed=99)
    mean = float(np.mean([profile.prefill_seconds(a.prompt_tokens) for a in sample]))
    return num_prefill / mean


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    start = time.perf_counter()
    for model, (make_profile, slo) in MODELS.items():
        profile = make_profile()
        for num_prefill, num_decode in RATIOS:
            capacity = prefill_capacity(profile, num_prefill)
            for packed in PACKED:
                config, cross = cluster(num_prefill, packed, profile)
                for load in LOADS:
                    rate = load * capacity
                    arrivals = workload(rate)
                    for policy in POLICIES:
                        pairs_only = policy.endswith("pairs only")
                        run = simulate(replace(config, router=replace(config.router, policy_options=NO_LOCAL))
                                       if pairs_only else config, "network-aware" if pairs_only else policy,
                                       arrivals, record_tokens=False)
                        records = [to_record(r) for r in run.requests]
                        s = summarize(records, slo=slo)
                        span = arrivals[-1].offset_s - arrivals[0].offset_s
                        s["goodput"] = s["slo_attainment"] * len(records) / span
                        placed_cross = sum(n for pair, n in run.decisions.items() if "->" in pair and _crosses(
                            config, pair)) / max(1, sum(run.decisions.values()))
                        rows.append({"model": model, "prefill": num_prefill, "decode": num_decode, "packed": packed,
                                     "cross_rack_pairs": round(cross, 3), "load": load, "rate": round(rate, 2),
                                     "policy": policy, "goodput": s["goodput"], "slo_attainment": s["slo_attainment"],
                                     "ttft_p50": s["ttft_p50"], "ttft_p90": s["ttft_p90"], "tpot_p50": s["tpot_p50"],
                                     "tpot_p90": s["tpot_p90"], "placed_cross_rack": round(placed_cross, 3),
                                     "local_runs": run.decisions.get("local", 0), "events": run.num_events,
                                     "wall_s": round(run.wall_s, 2)})
                        print(f"{model} {num_prefill}P{num_decode}D packed {packed:g} load {load:g} {policy}: "
                              f"goodput {s['goodput']:.1f} req/s ({s['slo_attainment']:.0%}), cross-rack "
                              f"{placed_cross:.0%}, {run.wall_s:.1f} s", flush=True)
    with open(OUT / "figure.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows)
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 0


def _crosses(config: ClusterConfig, pair: str) -> bool:
    nodes = {w.worker_id: w.node for w in config.workers}
    p, d = pair.split("->")
    return nodes[p].split("n")[0] != nodes[d].split("n")[0]


def best(rows, model, ratio, packed, policy):
    return max(r["goodput"] for r in rows if r["model"] == model and (r["prefill"], r["decode"]) == ratio
               and r["packed"] == packed and r["policy"] == policy)


def plot(rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(MODELS), len(RATIOS), figsize=(13, 6.5), squeeze=False)
    lines = ["| model | P:D | cross-rack pairs | " + " | ".join(f"{p} goodput" for p in POLICIES)
             + " | NA / RR | NA / LL | NA pairs only / LL |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, model in enumerate(MODELS):
        for j, ratio in enumerate(RATIOS):
            ax = axes[i][j]
            xs = [next(r["cross_rack_pairs"] for r in rows if r["model"] == model and
                       (r["prefill"], r["decode"]) == ratio and r["packed"] == packed) for packed in PACKED]
            for k, policy in enumerate(POLICIES):
                ys = [best(rows, model, ratio, packed, policy) for packed in PACKED]
                ax.plot(xs, ys, marker="o", label=policy, color=f"C{k}")
            for packed, x in zip(PACKED, xs):
                g = [best(rows, model, ratio, packed, p) for p in POLICIES]
                lines.append(f"| {model} | {ratio[0]}:{ratio[1]} | {x:.0%} | " + " | ".join(f"{v:.1f}" for v in g)
                             + f" | {g[2] / g[0]:.2f} | {g[2] / g[1]:.2f} | {g[3] / g[1]:.2f} |")
            ax.set(title=f"{model}-sized, {ratio[0]}P:{ratio[1]}D", xlabel="cross-rack share of P->D pairs",
                   ylabel="goodput (req/s meeting SLO, best rate)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Simulated: 32 GPUs, 2 racks (100 Gbit/s in rack, 25 across); profiles derived from H100 figures")
    fig.tight_layout()
    fig.savefig(OUT / "figure.png", dpi=110)
    (OUT / "figure.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
