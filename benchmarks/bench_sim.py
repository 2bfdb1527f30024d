"""Simulator scale: many workers, a long trace; events per second and peak memory.

    .venv/bin/python -m benchmarks.bench_sim --workers 1000 --requests 1000000

1. Writes (once) a synthetic trace in the Azure LLM-inference CSV format (TIMESTAMP as an
   ISO date-time, ContextTokens, GeneratedTokens; Poisson arrivals at `--rate`, lognormal
   lengths of mean 1,024 / 128 tokens clipped at 8,192 / 1,024) under `--trace-dir`, since
   the public traces cannot be downloaded here; `--trace FILE` replays a real one instead.
2. Loads it with loadgen's trace loader and simulates it on `--workers` workers (a quarter
   prefill), 8 per node, `--nodes-per-rack` nodes per rack: 100 Gbit/s within a rack,
   25 Gbit/s across; the 8B-sized H100 profile of pdserve/sim/profiles.py; the real placement policy.
3. Prints (and writes as JSON with `--out`): load time, simulation wall time, events,
   events/s, peak RSS, requests/s simulated, TTFT/TPOT percentiles.

`--policy network-aware` places with its search (router.placement.policies.search);
`--check-decisions` also places every request with its oracle, which prices every option
(router.placement.policies.oracle; slow beyond a few hundred workers), and stops at the first
decision that differs (sim.check), reporting how many were compared.

Requests are not kept (each is folded into the percentiles' arrays as it ends), token times
are not recorded, so memory grows with the requests in flight, not with the trace.
"""

from __future__ import annotations

import argparse
import array
import datetime as dt
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

from pdserve.router.placement.topology import Link, Topology
from pdserve.sim.check import CheckedNetworkAware, checked_policy
from pdserve.sim.config import ClusterConfig, EngineLimits, RouterConfig, WorkerConfig
from pdserve.sim.profiles import llama8b_h100
from pdserve.sim.run import simulate
from pdserve.sim.workload import trace_arrivals


def write_azure_trace(path: Path, num_requests: int, rate: float, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, num_requests)
    stamps = np.cumsum(gaps)
    n_in = np.clip(rng.lognormal(np.log(1024) - 0.5, 1.0, num_requests), 1, 8192).astype(int)
    n_out = np.clip(rng.lognormal(np.log(128) - 0.32, 0.8, num_requests), 1, 1024).astype(int)
    start = dt.datetime(2023, 11, 16, 18, 0, 0)
    with open(path, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for t, i, o in zip(stamps, n_in, n_out):
            f.write(f"{(start + dt.timedelta(seconds=float(t))).isoformat(sep=' ')},{i},{o}\n")


def two_tier_cluster(num_workers: int, *, prefill_share: float = 0.25, per_node: int = 8, nodes_per_rack: int = 4,
                     in_rack_gbps: float = 100.0, cross_rack_gbps: float = 25.0, profile=None,
                     engine: EngineLimits | None = None, stats_interval_s: float = 0.5) -> ClusterConfig:
    """Workers `per_node` to a node, nodes `nodes_per_rack` to a rack; prefill workers spread
    over the nodes round-robin so that every rack has both roles."""
    num_prefill = max(1, round(num_workers * prefill_share))
    num_nodes = -(-num_workers // per_node)
    nodes = [f"n{i:04d}" for i in range(num_nodes)]
    rack = {n: i // nodes_per_rack for i, n in enumerate(nodes)}
    workers = []
    stride = num_workers / num_prefill
    prefill_slots = {int(k * stride) for k in range(num_prefill)}
    np_, nd_ = 0, 0
    for i in range(num_workers):
        node = nodes[i // per_node]
        if i in prefill_slots:
            workers.append(WorkerConfig(f"p{np_:04d}", "prefill", node))
            np_ += 1
        else:
            workers.append(WorkerConfig(f"d{nd_:04d}", "decode", node))
            nd_ += 1
    links = tuple(Link(a, b, in_rack_gbps, 0.005) for a in nodes for b in nodes if a != b and rack[a] == rack[b])
    topology = Topology(links=links, remote_gbps=cross_rack_gbps, remote_latency_ms=0.010)
    return ClusterConfig(profile=profile or llama8b_h100(), workers=tuple(workers), topology=topology,
                         engine=engine or EngineLimits(num_blocks=16384, block_size=16, max_num_batched_tokens=8192,
                                                       max_num_seqs=128),
                         router=RouterConfig(stats_interval_s=stats_interval_s))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--rate", type=float, default=4000.0, help="mean arrival rate of the generated trace (req/s)")
    p.add_argument("--policy", default="least-loaded")
    p.add_argument("--trace", help="an Azure/Mooncake/BurstGPT trace to replay instead of the generated one")
    p.add_argument("--trace-dir", default="results/sim-traces", help="where the generated trace is kept")
    p.add_argument("--check-decisions", action="store_true",
                   help="network-aware: place with its oracle too and fail at the first decision that differs")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.check_decisions and args.policy != "network-aware":
        p.error("--check-decisions is for --policy network-aware")
    if args.workers < 2 or args.requests < 1:
        p.error("--workers must be >= 2 and --requests >= 1")

    trace = (Path(args.trace) if args.trace
             else Path(args.trace_dir) / f"azure-synthetic-{args.requests}-{args.rate:g}.csv")
    if not trace.exists():
        if args.trace:
            p.error(f"--trace: {trace} does not exist")
        trace.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        write_azure_trace(trace, args.requests, args.rate)
        print(f"wrote {trace} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    t = time.perf_counter()
    arrivals = trace_arrivals(str(trace), max_requests=args.requests)
    load_s = time.perf_counter() - t

    config = two_tier_cluster(args.workers)
    policy: str | CheckedNetworkAware = args.policy
    if args.check_decisions:
        policy = checked_policy(config)
    ttft = array.array("d")
    tpot = array.array("d")
    errors = [0]

    def done(r) -> None:
        if r.error is not None or r.first_token_time is None:
            errors[0] += 1
            return
        ttft.append(r.first_token_time - r.sent)
        if r.num_output_tokens > 1:
            tpot.append((r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1))

    run = simulate(config, policy, arrivals, record_tokens=False, keep=False, on_complete=done)
    del arrivals
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak_mib = usage.ru_maxrss / 1024
    figures = {
        "workers": args.workers, "requests": len(ttft) + errors[0], "errors": errors[0], "policy": args.policy,
        "trace": trace.name, "trace_load_s": round(load_s, 1), "sim_wall_s": round(run.wall_s, 1),
        "events": run.num_events, "events_per_s": round(run.num_events / run.wall_s),
        "process_cpu_s": round(usage.ru_utime + usage.ru_stime, 1),  # wall minus what other processes took
        "simulated_s": round(run.sim_end_s, 1), "peak_rss_mib": round(peak_mib),
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
        "tpot_p50_s": float(np.percentile(tpot, 50)), "tpot_p90_s": float(np.percentile(tpot, 90)),
        "preemptions": run.num_preemptions,
    }
    if args.check_decisions:
        figures["decisions_checked"] = policy.checked  # type: ignore[union-attr]
    print(json.dumps(figures, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
