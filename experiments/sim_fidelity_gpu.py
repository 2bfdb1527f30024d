"""Simulated vs real on the GPU: the committed H100 PD TTFT run (docs/results/h100_pd_ttft.json).

    .venv/bin/python -m experiments.sim_fidelity_gpu      # seconds

The real run (benchmarks/bench_pd_ttft.py on one H100, two worker processes, UCX over CUDA
IPC, link paced at 1/10/25/100 Gbit/s): `random:llama-3.2-1b`, 2,048-token prompts, one
request at a time, 32 output tokens. No `pdserve profile` of that model exists, so the
simulator's profile takes the same run's colocated figures: prefill of 2,048 tokens =
colocated TTFT p50 (15.4 ms), decode step = colocated TPOT (1.91 ms); KV = 16 layers x 8 KV
heads x 64 x 2 x bf16 = 32,768 B/token. Two link models: the set rate, and the rate the
run's transfers achieved (its `kv_gbps`, what the router's link EWMA would learn).
Writes results/sim-fidelity/gpu_pd_ttft.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pdserve.router.placement.profiles import Profile
from pdserve.router.placement.topology import Link, Topology
from pdserve.sim.config import ClusterConfig, EngineLimits, WorkerConfig
from pdserve.sim.run import Arrival, simulate, to_record

ROOT = Path(__file__).resolve().parent.parent
KV_BYTES = 16 * 8 * 64 * 2 * 2


def main() -> int:
    real = json.loads((ROOT / "docs" / "results" / "h100_pd_ttft.json").read_text())
    args = real["args"]
    colocated = next(r for r in real["rows"] if r["mode"] == "colocated")
    profile = Profile(
        hardware="NVIDIA H100 80GB HBM3 (from the run's colocated figures)", device="cuda",
        model=f"{args['model']} (2 points from the same run, not profiled)", dtype="bfloat16", num_layers=16,
        kv_bytes_per_token=KV_BYTES, block_size=16, max_num_batched_tokens=8192,
        prefill_tokens=(args["prompt_len"],), prefill_times=(colocated["ttft_p50"],),
        decode_batch_sizes=(1,), decode_contexts=(args["prompt_len"],), decode_times=((colocated["tpot_mean"],),),
    )
    lines = ["# Simulated vs real: PD TTFT on one H100 (docs/results/h100_pd_ttft.json)", "",
             f"{args['requests']} requests one at a time, {args['prompt_len']}-token prompts, {args['model']}; "
             "real = the committed run; error = (sim - real) / real.", "",
             "| link set Gbit/s | achieved Gbit/s | real TTFT p50 ms | sim, set rate (err) "
             "| sim, achieved rate (err) |",
             "|---|---|---|---|---|"]
    for row in real["rows"]:
        if row["mode"] != "disaggregated":
            continue
        sims = []
        for gbps in (row["gbps"], row["kv_gbps"]):
            config = ClusterConfig(
                profile=profile, topology=Topology(links=(Link("a", "b", gbps, 0.0),)),
                workers=(WorkerConfig("p0", "prefill", "a"), WorkerConfig("d0", "decode", "b")),
                engine=EngineLimits(num_blocks=4096, block_size=16, max_num_batched_tokens=8192, max_num_seqs=8))
            arrivals = [Arrival(10.0 * i, args["prompt_len"], args["max_tokens"]) for i in range(args["requests"])]
            ttfts = sorted(to_record(r).ttft_s for r in simulate(config, "round-robin", arrivals).requests)
            sims.append(ttfts[len(ttfts) // 2])
        real_ms = row["ttft_p50"] * 1e3
        cells = [f"{s * 1e3:.1f} ({(s * 1e3 - real_ms) / real_ms:+.0%})" for s in sims]
        lines.append(f"| {row['gbps']:g} | {row['kv_gbps']:.1f} | {real_ms:.1f} | {cells[0]} | {cells[1]} |")
    out = ROOT / "results" / "sim-fidelity" / "gpu_pd_ttft.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
