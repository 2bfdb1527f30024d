"""Ready means warm, measured: the first loadgen run after `pdserve up` says ready against the next.

    python3 -m experiments.bench_warm_start [--replicas 2] [--model random:llama-3.1-8b]

Starts `pdserve up --mode colocated --replicas N` (one mixed worker per GPU), times how long it
takes until the router answers `/v1/models`, then runs the same load twice on that server
(`pdserve-loadgen run`: --requests at --rate req/s, Poisson arrivals, --input-len / --output-len
tokens, ignore_eos) and prints TTFT and TPOT p50 of each run and their ratio (target: the first
within 10% of the second), the achieved request rate, and the workers' start-up log lines
(load, warm-up parts). The server is stopped at the end (SIGINT, then SIGKILL after 60 s).

`--device cpu --model random:smollm2-135m --replicas 1 --requests 6 --rate 2 --input-len 16 --output-len 4`
runs the same steps on a CPU (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request

from pdserve.loadgen.launcher import ServerProcess, free_port


def engine_counters(url: str) -> dict[str, float]:
    """The workers' engine-step counters summed over workers, from the router's /metrics
    ({} when the router does not export them)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if (line.startswith("pdserve:engine_") or line.startswith("pdserve:worker_process_")) and "_total{" in line:
            name = line.split("{", 1)[0].removeprefix("pdserve:engine_").removeprefix("pdserve:worker_")
            name = name.removesuffix("_total")
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def engine_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    if not before or not after:
        return {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps, dsteps = d.get("steps", 0.0), d.get("decode_only_steps", 0.0)
    other = steps - dsteps
    return {"steps": steps, "decode_only_steps": dsteps, "other_steps": other, "idle_s": d.get("idle_seconds", 0.0),
            "step_s": d.get("step_seconds", 0.0), "engine_cpu_s": d.get("cpu_seconds", 0.0),
            "process_cpu_s": d.get("process_cpu_seconds", 0.0),
            "decode_only_ms": d.get("decode_only_step_seconds", 0.0) / max(dsteps, 1) * 1e3,
            "other_ms": (d.get("step_seconds", 0.0) - d.get("decode_only_step_seconds", 0.0)) / max(other, 1) * 1e3}


def loadgen(url: str, args, seed: int) -> dict:
    cmd = [sys.executable, "-m", "pdserve.loadgen.cli", "run", "--url", url, "--num-requests", str(args.requests),
           "--rate", str(args.rate), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--ignore-eos", "--seed", str(seed), "--json", "--no-progress", "--no-metrics",
           "--max-run-time", str(args.max_run_time)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=args.max_run_time + 120)
    return json.loads(out.stdout[out.stdout.index("{"):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=16.0)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256, help="each worker's (cuda)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="each worker's token budget (cuda)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"])
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--max-run-time", type=float, default=300.0)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    fd, log_path = tempfile.mkstemp(prefix="pdserve-up-", suffix=".log")
    os.close(fd)
    cmd = [sys.executable, "-m", "pdserve.launcher.cli", "up", "--mode", "colocated", "--replicas", str(args.replicas),
           "--model", args.model, "--device", args.device, "--port", str(port), "--host", "127.0.0.1",
           "--kv-cache-dtype", args.kv_cache_dtype, "--startup-timeout-s", str(args.startup_timeout)]
    if args.device == "cuda":
        cmd += ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--worker-gpus", "1"]
    else:
        cmd += ["--worker-gpus", "0"]
    server = ServerProcess(cmd, health_url=url + "/v1/models", log_path=log_path, env={"PYTHONUNBUFFERED": "1"},
                           name="pdserve up", startup_timeout_s=args.startup_timeout, shutdown_timeout_s=60,
                           stop_signal=signal.SIGINT, poll_interval_s=1.0)
    print("starting:", " ".join(cmd[2:]), flush=True)
    results: dict = {"model": args.model, "replicas": args.replicas, "rate": args.rate, "requests": args.requests,
                     "input_len": args.input_len, "output_len": args.output_len}
    try:
        server.launch()
        results["startup_s"] = server.startup_s
        print(f"ready after {results['startup_s']:.1f}s", flush=True)
        runs = []
        for i in range(2):
            before = engine_counters(url)
            summary = loadgen(url, args, seed=i)
            summary["engine"] = steps = engine_delta(before, engine_counters(url))
            runs.append(summary)
            print(f"run {i + 1}: TTFT p50 {summary['ttft_p50'] * 1e3:.0f} ms, "
                  f"TPOT p50 {summary['tpot_p50'] * 1e3:.1f} ms, "
                  f"{summary['request_throughput']:.2f} req/s achieved, {summary['num_errors']} errors", flush=True)
            if steps:
                print(f"  engine steps (all workers, from the router's /metrics): {steps['steps']:.0f}: "
                      f"{steps['decode_only_steps']:.0f} decode-only, {steps['decode_only_ms']:.1f} ms each; "
                      f"{steps['other_steps']:.0f} with prefill work, {steps['other_ms']:.1f} ms each; "
                      f"idle {steps['idle_s']:.1f} s; CPU: engine thread {steps['engine_cpu_s']:.1f} s in "
                      f"{steps['step_s']:.1f} s of steps, the worker process {steps['process_cpu_s']:.1f} s",
                      flush=True)
        results["runs"] = runs
        for key in ("ttft_p50", "tpot_p50"):
            results[f"{key}_first_over_second"] = runs[0][key] / runs[1][key]
        print(f"first / second: TTFT p50 {results['ttft_p50_first_over_second']:.2f}, TPOT p50 "
              f"{results['tpot_p50_first_over_second']:.2f} (target: within 0.90-1.10)")
    finally:
        server.stop()
        with open(log_path, errors="replace") as log:
            text = log.read().splitlines()
        if "runs" not in results:
            print("server log tail:\n  " + "\n  ".join(text[-20:]))
        lines = [line.rstrip() for line in text if "warm-up" in line or "loaded in" in line or "start-up" in line]
        results["startup_log"] = lines
        print("worker start-up (from the server log):")
        for line in lines:
            print("  " + line[-400:])
        os.unlink(log_path)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
