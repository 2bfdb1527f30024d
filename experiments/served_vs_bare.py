"""What serving adds to the engine, in one command: the bare engine against `pdserve up` with its defaults.

    python3 -m experiments.served_vs_bare [--model random:llama-3.1-8b] [--requests 90] [--rate 6] \
        [--input-len 2048] [--output-len 256] [--out DIR]

Every figure comes from a fresh process started the way a user starts it, and each run draws new
prompts (a seed of its own: repeated prompts hit the prefix cache and look several times faster):

1. bare: `benchmarks/bench_engine_replay.py` (the same workload fed to an `LLMEngine` in its own
   process, TTFT/TPOT taken at the engine), twice, with the engine's defaults for the device;
2. served: `pdserve up --mode colocated --replicas 1` with its defaults (nothing but the model and
   the device given), then `pdserve-loadgen run` twice against it: the first run after ready and
   the second (the cold-start check);
3. disaggregated: `pdserve up --mode disaggregated` with one prefill and one decode worker (on one
   GPU they share it, `--worker-gpus 0.5`), one loadgen run; its errors and the router's KV
   fallbacks (`pdserve:request_recoveries_total`) are counted.

It prints one table (TTFT and TPOT p50/p90, achieved rate, errors, the server's prefix-cache hit
rate, and how many of the workers' steps that were not decode-only replayed the prefill graphs)
and the ratios the GPU-serving issue asks for: served TTFT p50 minus bare, served TPOT p50 over
bare, first run over second. `--device cpu --model random:tiny-llama --requests 4 --rate 2
--input-len 16 --output-len 4` is the smoke test the CPU tests run. Writes `DIR/served_vs_bare.json`
with every run's summary when --out is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from experiments.gpu_serving import Cluster, log
from pdserve.loadgen.launcher import free_port
from pdserve.loadgen.server_metrics import parse_prometheus_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def metric_totals(url: str) -> dict[str, float]:
    """Each series' sum over its samples in the router's /metrics (empty when unreachable)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return parse_prometheus_text(text)


def metric_total(url: str, name: str) -> float:
    """The sum of a counter's samples in the router's /metrics (0 when absent)."""
    return metric_totals(url).get(name, 0.0)


class Server(Cluster):
    """`pdserve up` (gpu_serving.Cluster: its own process group, SIGINT then SIGKILL) with this
    benchmark's model and device, logging to OUT/server-LABEL.log."""

    def __init__(self, args: argparse.Namespace, extra: list[str], label: str, out_dir: str):
        self.logfile = os.path.join(out_dir, f"server-{label}.log")
        log(f"{label}: pdserve up {' '.join(extra)}")
        super().__init__(["--model", args.model, "--device", args.device, "--host", "127.0.0.1",
                          "--startup-timeout-s", str(args.startup_timeout), *extra],
                         free_port(), self.logfile, args.startup_timeout)

    def chosen(self) -> list[str]:
        """The lines where `pdserve up` says which engine settings it chose."""
        with open(self.logfile) as f:
            return [line.strip() for line in f if "engine:" in line and "max_num_batched_tokens" in line]


STEP_COUNTERS = {"steps": "pdserve:engine_steps_total", "decode_only_steps": "pdserve:engine_decode_only_steps_total",
                 "prefill_graph_steps": "pdserve:engine_prefill_graph_steps_total"}


def step_counts(url: str) -> dict[str, float]:
    """The workers' engine step counters, summed over workers, as the router's /metrics has them."""
    totals = metric_totals(url)
    return {key: totals.get(name, 0.0) for key, name in STEP_COUNTERS.items()}


def served_run(url: str, args: argparse.Namespace, seed: int) -> dict:
    """One loadgen run against `url`, with the steps the workers ran during it: `prefill_steps`
    (steps that were not decode-only) and how many of them replayed the prefill graphs. The
    router polls its workers' counters every 0.5 s: read a second after the run ends."""
    before = step_counts(url)
    summary = loadgen(url, args, seed)
    time.sleep(1.0)
    after = step_counts(url)
    d = {key: after[key] - before[key] for key in STEP_COUNTERS}
    summary["prefill_steps"] = int(d["steps"] - d["decode_only_steps"])
    summary["prefill_graph_steps"] = int(d["prefill_graph_steps"])
    return summary


def loadgen(url: str, args: argparse.Namespace, seed: int) -> dict:
    cmd = [sys.executable, "-m", "pdserve.loadgen.cli", "run", "--url", url, "--num-requests", str(args.requests),
           "--rate", str(args.rate), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--ignore-eos", "--seed", str(seed), "--json", "--no-progress", "--max-run-time", str(args.max_run_time)]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=args.max_run_time + 120)
    return json.loads(out.stdout[out.stdout.index("{"):])


def bare(args: argparse.Namespace, out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "bare.json")
    cmd = [sys.executable, "-m", "benchmarks.bench_engine_replay", "--device", args.device,
           "--model", args.model, "--requests", str(args.requests), "--rate", str(args.rate),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--runs", "2",
           "--seed", str(args.seed), "--max-run-time", str(args.max_run_time), "--json", path]
    log("bare: " + " ".join(cmd[1:]))
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         timeout=args.startup_timeout + 3 * args.max_run_time)
    sys.stdout.write(out.stdout)
    if out.returncode != 0:
        raise RuntimeError(f"bench_engine_replay failed ({out.returncode}): {out.stderr[-2000:]}")
    with open(path) as f:
        runs = json.load(f)["runs"]
    return [{"ttft_p50": r["ttft_p50_ms"] / 1e3, "ttft_p90": r["ttft_p90_ms"] / 1e3, "tpot_p50": r["tpot_p50_ms"] / 1e3,
             "tpot_p90": r["tpot_p90_ms"] / 1e3, "request_throughput": r["achieved_rate"],
             "num_errors": r["requests"] - r["completed"]} for r in runs]


def row(label: str, s: dict) -> str:
    hit = s.get("prefix_cache_hit_rate")
    hit_text = f"{hit * 100:.0f}%" if isinstance(hit, (int, float)) else "n/a"
    graphs = f"{s['prefill_graph_steps']} of {s['prefill_steps']}" if "prefill_steps" in s else "n/a"
    return (f"| {label} | {s['ttft_p50'] * 1e3:.0f} | {s['ttft_p90'] * 1e3:.0f} | {s['tpot_p50'] * 1e3:.1f} | "
            f"{s['tpot_p90'] * 1e3:.1f} | {s['request_throughput']:.2f} | {s['num_errors']} | {hit_text} | {graphs} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3.1-8b", help="model (default %(default)s)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="device (default %(default)s)")
    p.add_argument("--requests", type=int, default=90, help="requests per run (default %(default)s)")
    p.add_argument("--rate", type=float, default=6.0, help="Poisson arrival rate, req/s (default %(default)s)")
    p.add_argument("--input-len", type=int, default=2048, help="prompt tokens (default %(default)s)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens (default %(default)s)")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000,
                   help="first seed; each run adds to it, so every run draws new prompts (default: the clock)")
    p.add_argument("--modes", default="bare,colocated,disaggregated",
                   help="which of bare, colocated, disaggregated to run (default %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds to wait for a server (default %(default)s)")
    p.add_argument("--max-run-time", type=float, default=300.0, help="seconds per loadgen run (default %(default)s)")
    p.add_argument("--kv-backends", default="ucx",
                   help="KV backends of the disaggregated run, comma-separated: one run each (default %(default)s; "
                        "nixl needs pdserve[nixl])")
    p.add_argument("--out", default=None, help="write logs and served_vs_bare.json here (default: a temporary folder)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("bare", "colocated", "disaggregated")]
    if bad:
        p.error(f"--modes: unknown mode(s) {', '.join(bad)}")
    out_dir = args.out or tempfile.mkdtemp(prefix="served-vs-bare-")
    os.makedirs(out_dir, exist_ok=True)
    gpu_args = ["--worker-gpus", "1"] if args.device == "cuda" else ["--worker-gpus", "0"]
    results: dict = {"args": vars(args), "runs": {}}
    rows = []
    json_path = os.path.join(out_dir, "served_vs_bare.json")

    def record(label: str, summary: dict) -> None:
        """Keep a run as soon as it ends: its row printed and the JSON so far written, so a call
        cut short (a device's time limit) still leaves what it measured."""
        results["runs"][label] = summary
        log(f"{label}: {row(label, summary)}")
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)

    if "bare" in modes:
        for i, s in enumerate(bare(args, out_dir)):
            record(f"bare run {i + 1}", s)
    if "colocated" in modes:
        server = Server(args, ["--mode", "colocated", "--replicas", "1", *gpu_args], "colocated", out_dir)
        try:
            results["chosen"] = server.chosen()
            for i in range(2):
                record(f"served run {i + 1}", served_run(server.url, args, seed=args.seed + 10 + i))
        finally:
            server.stop()
        results["colocated_startup_s"] = server.startup_s
    backends = [b.strip() for b in args.kv_backends.split(",") if b.strip()]
    if not backends or any(b not in ("ucx", "nixl") for b in backends):
        p.error(f"--kv-backends: ucx and/or nixl, comma-separated, got {args.kv_backends!r}")
    for n, backend in enumerate(backends if "disaggregated" in modes else []):
        share = ["--worker-gpus", "0.5"] if args.device == "cuda" else ["--worker-gpus", "0"]
        label = "disaggregated 1P+1D" + ("" if backends == ["ucx"] else f" {backend}")
        server = Server(args, ["--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--kv-backend", backend,
                               *share], label.replace(" ", "-"), out_dir)
        try:
            s = served_run(server.url, args, seed=args.seed + 20 + n)
            s["kv_fallbacks"] = metric_total(server.url, "pdserve:request_recoveries_total")
            record(label, s)
        finally:
            server.stop()

    print()
    for line in results.get("chosen", []):
        print("server chose: " + line.split("engine:", 1)[1].strip())
    print("| run | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms | req/s | errors | prefix-cache hits "
          "| prefill-graph steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, s in results["runs"].items():
        rows.append(row(label, s))
        print(rows[-1])
    runs = results["runs"]
    ratios = {}
    if "bare run 2" in runs and "served run 2" in runs:
        b, s = runs["bare run 2"], runs["served run 2"]
        ratios["served_minus_bare_ttft_p50_ms"] = (s["ttft_p50"] - b["ttft_p50"]) * 1e3
        ratios["served_over_bare_tpot_p50"] = s["tpot_p50"] / b["tpot_p50"]
    if "served run 1" in runs and "served run 2" in runs:
        ratios["first_over_second_ttft_p50"] = runs["served run 1"]["ttft_p50"] / runs["served run 2"]["ttft_p50"]
        ratios["first_over_second_tpot_p50"] = runs["served run 1"]["tpot_p50"] / runs["served run 2"]["tpot_p50"]
    for label, d in runs.items():
        if label.startswith("disaggregated 1P+1D"):
            suffix = label[len("disaggregated 1P+1D"):].strip().replace(" ", "_")
            ratios["disaggregated_errors" + (f"_{suffix}" if suffix else "")] = d["num_errors"]
            ratios["disaggregated_kv_fallbacks" + (f"_{suffix}" if suffix else "")] = d["kv_fallbacks"]
    results["ratios"] = ratios
    print()
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=2)
    log(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
