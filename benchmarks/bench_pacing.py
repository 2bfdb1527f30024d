"""Pacing accuracy: a KV transfer between two processes over UCX, paced by the sender's
token bucket (kvtransfer LinkPacer, spec string from pdserve.emulation.pacing_spec).

Both processes use the same device: on a GPU machine, two processes on GPU 0 (UCX then
moves the KV by CUDA IPC, which no kernel shaping could hold: that is what pacing is
for); without CUDA, host memory (UCX shared memory / TCP). SmolLM2-135M-shaped caches
(30 layers, 3 KV heads, head_dim 64, fp32). First the unpaced ceiling, then each rate.
Achieved = KV bytes / (first send_layer .. receiver's ACK), median of ``--transfers``.
A set rate above ~90% of the unpaced ceiling is marked as not held.

    python benchmarks/bench_pacing.py [--device auto|cpu|cuda] [--rates 1 10 25 100]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 10, 25, 100])
    parser.add_argument("--transfers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="target duration of one transfer")
    parser.add_argument("--max-mb", type=float, default=2000.0, help="largest transfer (MB)")
    args = parser.parse_args()
    if args.transfers < 1 or args.seconds <= 0 or any(r <= 0 for r in args.rates):
        parser.error("--transfers, --seconds and --rates must be positive")

    import torch

    from pdserve.emulation.kvprobe import format_table, measure, summarize, transfer_mb

    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        print(f"bench_pacing: --device cuda requested but CUDA is not available (torch {torch.__version__}, "
              f"cuda build: {torch.version.cuda}); nothing measured. Use --device cpu.", file=sys.stderr)
        return 2
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu"
    if device == "cpu" and args.device == "auto":
        print("bench_pacing: CUDA is not available; measuring on CPU (host memory, UCX shm/tcp). "
              "On a GPU machine this measures two processes on GPU 0 (CUDA IPC).\n")
    hardware = torch.cuda.get_device_name(0) if device == "cuda" else \
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    print(f"KV pacing, SmolLM2-135M-shaped KV (fp32), two processes on {device} ({hardware}); "
          f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}; median of {args.transfers} transfers after a warm-up")

    def spawn(side, argv):
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    ceiling_result = measure(spawn, "127.0.0.1", transfer_mb(None, 0, high=args.max_mb),
                             args.transfers, device=device)
    ceiling_row = summarize(None, "none (unpaced)", ceiling_result)
    ceiling = ceiling_row["achieved_gbps"]
    rows = [ceiling_row]
    for rate in args.rates:
        mb = transfer_mb(min(rate, ceiling), args.seconds, high=args.max_mb)
        result = measure(spawn, "127.0.0.1", mb, args.transfers, pacing=f"default={rate:g}", device=device)
        rows.append(summarize(rate, "pacing", result, ceiling))
        print(f"  {rate:g} Gbit/s done", file=sys.stderr, flush=True)
    print()
    print(format_table(rows))
    print("\nachieved: sender side, first send_layer to ACK; recv: receiver side, first layer landed to last "
          "(excludes the first layer, so it reads high by ~1/30); ratio = achieved / set.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
