"""KV precision chosen by the link, on a paced 1P+1D cluster: full vs auto per link rate.

    python -m experiments.kv_precision_sweep                 # CPU: SmolLM2, 1, 10, 25, 100 Gbit/s and host
    python -m experiments.kv_precision_sweep --quick         # CPU: 1 and 100 Gbit/s, 4 requests of 512 tokens
    python -m experiments.kv_precision_sweep --device cuda   # one GPU: random:llama-3.1-8b, 2048/256, SLO 1 s
    python -m experiments.kv_precision_sweep --out DIR/kv_precision.json

1. one prefill and one decode worker start once (launcher.paced workers; no prefix cache; with
   `--device cuda` both on GPU 0, each with `--gpu-memory-fraction` of it): the prefill worker
   paces its KV sends from a file, so a cell's link rate is real;
2. for each rate and each precision in (full, auto), a network-aware router (the profile
   `--profile`, `--slo-ttft`) sets the link to the rate and serves with `--kv-wire-precision`
   full or auto (auto: the policy picks per request, router.placement.policies.cost.choose_kv_precision);
   `host` is the same pair at 1000 Gbit/s (as good as unpaced shared memory on one host). With
   `--no-local-prefill` (the default with `--device cuda`, where a decode worker sharing the GPU
   would otherwise prefill every prompt itself at these rates) every request crosses the link;
3. a bounded load of `--requests` new prompts (synthetic, seeded per cell so no prompt repeats and
   no prefix is reused) at `--rate` requests/s, and with `--link-load F` at most F x what the
   link carries at full precision (the profile's KV bytes per token x `--input-len`), so the
   slow links are not simply a queue; `--input-len` tokens each, `--output-len` out;
4. per cell: TTFT p50; the KV part of TTFT p50 (`kv_tail` of the router's per-request timing: the
   transfer's time after prefill ends, which TTFT waits for) and the whole transfer's p50 (`kv`);
   goodput at TTFT <= `--slo-ttft` (requests/s that met it, over the cell's span); the precision
   each request went at; the KV bytes on the wire per request. Then full/auto ratios per rate.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

from pdserve.loadgen.launcher import ServerProcess, free_port

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "experiments" / "profile-smollm2-cpu-1thread-2026-12-01.json"
# measured by `pdserve profile` on one H200 for experiments/run_gpu_grid.sh (record docs/records/gpu-grid.tar.xz)
PROFILE_CUDA = REPO / "experiments" / "profile-llama8b-h200-2026-11-30.json"
# --device presets: (model, workers' flags, input, output, rate, SLO s, requests, local prefill)
PRESETS = {
    "cpu": ("smollm2", ["--device", "cpu", "--kv-cache-gib", "1"], 1024, 4, 0.25, 3.0, 12, True),
    "cuda": ("random:llama-3.1-8b", ["--gpu-memory-fraction", "0.3"], 2048, 256, 1.0, 1.0, 10, False),
}
HOST_GBPS = 1000.0  # the "host" cell: a link this fast is not the bound anywhere here


def process(argv: list[str], log: Path, name: str, **options) -> ServerProcess:
    """`argv` from this checkout (first on PYTHONPATH), in its own process group, output to `log`,
    not started yet; stopped with SIGTERM, then SIGKILL after 30 s."""
    pythonpath = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return ServerProcess(argv, log_path=log, cwd=REPO, env={"PYTHONPATH": pythonpath}, name=name,
                         shutdown_timeout_s=30, poll_interval_s=0.5, **options)


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


@functools.lru_cache(maxsize=None)
def kv_bytes_per_token(profile: str) -> int:
    return json.loads(Path(profile).read_text())["kv_bytes_per_token"]


def cell_rate(args, gbps: float) -> float:
    """--rate, capped at --link-load x the requests/s the link carries at full precision."""
    if not args.link_load:
        return args.rate
    kv_bytes = kv_bytes_per_token(args.profile) * args.input_len
    return min(args.rate, args.link_load * gbps * 1e9 / 8 / kv_bytes)


def run_cell(args, state: Path, gbps: float, precision: str, seed: int) -> dict:
    from pdserve.loadgen.client import ClientConfig
    from pdserve.loadgen.datasets import DatasetConfig, LengthDist
    from pdserve.loadgen.runner import LoadConfig, run_load

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = state / f"router-{gbps:g}-{precision}.log"
    router = process([sys.executable, "-m", "pdserve.launcher.paced", "router", "--state", str(state), "--policy",
                      "network-aware", "--profile", str(args.profile), "--slo-ttft", f"{args.slo_ttft:g}",
                      "--bandwidth", f"{gbps:g}", "--port", str(port), "--kv-wire-precision", precision,
                      "--kv-deadline-s", "60"] + ([] if args.local_prefill else ["--no-local-prefill"]),
                     log, "router", health_url=f"{base}/health", startup_timeout_s=180)
    rate = cell_rate(args, gbps)
    try:
        router.launch()
        cfg = LoadConfig(
            client=ClientConfig(base_url=base, endpoint="completions", ignore_eos=True, temperature=0.0,
                                request_timeout_s=300),
            rate=rate, arrival="constant", num_requests=args.requests, seed=seed,
            dataset=DatasetConfig(kind="synthetic", input=LengthDist.parse(str(args.input_len)),
                                  output=LengthDist.parse(str(args.output_len))),
            max_run_time_s=args.requests / rate + 600, scrape_metrics=False,
        )
        result = run_load(cfg, progress=False)
    finally:
        router.stop()
    ok = [r for r in result.records if r.ok]
    timing = [r.server_timing or {} for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    span = max((r.sent_s + (r.e2e_s or 0) for r in ok), default=0) - min((r.sent_s for r in ok), default=0)
    met = sum(1 for t in ttft if t <= args.slo_ttft)
    wire = [t["kv_bytes"] for t in timing if t.get("kv_bytes")]
    return {
        "gbps": gbps, "precision": precision, "rate_rps": rate, "requests": len(result.records), "ok": len(ok),
        "ttft_p50_s": p50(ttft),
        "tpot_p50_s": p50([(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1) for r in ok
                           if r.ttft_s is not None and r.num_output_tokens > 1]),
        "kv_tail_p50_s": p50([t["kv_tail"] for t in timing if t.get("kv_tail") is not None]),
        "kv_p50_s": p50([t["kv"] for t in timing if t.get("kv") is not None]),
        "slo_met": met, "goodput_rps": met / span if span > 0 else 0.0,
        "chosen": dict(Counter(t.get("kv_precision") or "local" for t in timing)),
        "wire_mb_per_request": (sum(wire) / len(wire) / 1e6) if wire else None,
        "reason": next((t.get("kv_precision_reason") for t in timing if t.get("kv_precision_reason")), None),
        "reasons": [t.get("kv_precision_reason") for t in timing],
        # each completed request as the client saw it and the router timed it (where the KV's time went)
        "per_request": [{"ttft_s": r.ttft_s, **(r.server_timing or {})} for r in ok],
    }


def fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(cells: list[dict], slo: float) -> str:
    lines = ["| link | precision | TTFT p50 s | KV part of TTFT p50 s | KV transfer p50 s | "
             f"goodput at TTFT <= {slo:g} s "
             "(req/s, met/ok) | chosen | wire MB/request |", "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        link = "host" if c["gbps"] == HOST_GBPS else f"{c['gbps']:g} Gbit/s"
        chosen = ", ".join(f"{k} {v}" for k, v in sorted(c["chosen"].items()))
        lines.append(f"| {link} | {c['precision']} | {fmt(c['ttft_p50_s'])} | {fmt(c['kv_tail_p50_s'])} | "
                     f"{fmt(c['kv_p50_s'])} | {c['goodput_rps']:.3f} ({c['slo_met']}/{c['ok']}) | {chosen} | "
                     f"{fmt(c['wire_mb_per_request'], '.1f')} |")
    other = "auto" if any(c["precision"] == "auto" for c in cells) else "fp8"  # the ratios' second column
    lines += ["", f"| link | TTFT p50 full/{other} | KV part p50 full/{other} | KV transfer p50 full/{other} | "
              f"goodput {other}/full |",
              "|---|---|---|---|---|"]
    by = {(c["gbps"], c["precision"]): c for c in cells}

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "-"

    for gbps in dict.fromkeys(c["gbps"] for c in cells):
        full, auto = by.get((gbps, "full")), by.get((gbps, "auto")) or by.get((gbps, "fp8"))
        if not (full and auto):
            continue
        link = "host" if gbps == HOST_GBPS else f"{gbps:g} Gbit/s"
        lines.append(f"| {link} | {ratio(full['ttft_p50_s'], auto['ttft_p50_s'])} | "
                     f"{ratio(full['kv_tail_p50_s'], auto['kv_tail_p50_s'])} | "
                     f"{ratio(full['kv_p50_s'], auto['kv_p50_s'])} | "
                     f"{ratio(auto['goodput_rps'], full['goodput_rps'])} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=tuple(PRESETS), default="cpu",
                    help="cpu: SmolLM2 on the CPU; cuda: random:llama-3.1-8b, both workers on GPU 0")
    ap.add_argument("--model", default=None, help="default: the --device preset's")
    ap.add_argument("--rates", default="1,10,25,100,host", help="Gbit/s, comma-separated; host = 1000")
    ap.add_argument("--precisions", default="full,auto")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None, help="requests/s (constant arrivals)")
    ap.add_argument("--link-load", type=float, default=None,
                    help="cap a cell's rate at this fraction of the link's full-precision capacity "
                         "(default: 0.5 with --device cuda, none on the CPU)")
    ap.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO, seconds (CPU 3: a 1024-token prefill "
                    "takes ~1 s there; cuda 1)")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--no-local-prefill", dest="local_prefill", action="store_false", default=None,
                    help="every request crosses the link (the default with --device cuda)")
    ap.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                    help="an extra worker flag (repeatable; e.g. --worker-arg=--max-num-seqs=64)")
    ap.add_argument("--seed", type=int, default=0, help="cell i draws its prompts with seed + i (new prompts per run)")
    ap.add_argument("--quick", action="store_true", help="1 and 100 Gbit/s, 4 requests of 512 tokens")
    ap.add_argument("--out", default=None, help="write the cells as JSON here (and the table beside it, .md)")
    args = ap.parse_args()
    model, worker_flags, input_len, output_len, rate, slo, requests, local = PRESETS[args.device]
    args.model = args.model or model
    for name, value in (("input_len", input_len), ("output_len", output_len), ("rate", rate), ("slo_ttft", slo),
                        ("requests", requests), ("local_prefill", local)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.link_load is None:
        args.link_load = 0.5 if args.device == "cuda" else 0.0
    args.profile = args.profile or str(PROFILE_CUDA if args.device == "cuda" else PROFILE)
    if args.quick:
        args.rates, args.requests, args.input_len = "1,100", 4, 512
    rates = [HOST_GBPS if r.strip() == "host" else float(r) for r in args.rates.split(",") if r.strip()]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for p in precisions:
        if p not in ("full", "auto", "fp8"):
            ap.error(f"--precisions: {p!r} is not full, auto or fp8")
    state = Path(tempfile.mkdtemp(prefix="kv-precision-sweep-"))
    log = state / "workers.log"
    gpus = ["--gpus", "0"] if args.device == "cuda" else []
    workers = process([sys.executable, "-m", "pdserve.launcher.paced", "workers", "--state", str(state), "--model",
                       args.model, "--prefill", "1", "--decode", "1", *gpus, "--", "--no-prefix-caching",
                       *worker_flags, *args.worker_arg], log, "workers", health_url=None, startup_timeout_s=600)
    workers.start()
    cells = []
    try:
        workers.wait_until(lambda: (state / "cluster.json").exists(), "they wrote cluster.json")
        seed = args.seed
        for gbps in rates:
            for precision in precisions:
                seed += 1
                cell = run_cell(args, state, gbps, precision, seed)
                print(json.dumps(cell), flush=True)
                cells.append(cell)
    finally:
        workers.stop()
    text = table(cells, args.slo_ttft)
    print(text)
    if args.out:
        record = {"args": vars(args) | {"profile": os.path.relpath(args.profile, REPO)}, "cells": cells}
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(text + "\n")
    return 0 if all(c["ok"] == c["requests"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
