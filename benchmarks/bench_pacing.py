"""Pacing accuracy: a KV transfer between two processes over UCX, paced by the sender's
token bucket (kvtransfer LinkPacer, spec string from kvtransfer.pacing_spec).

Both processes use the same device: on a GPU machine, two processes on GPU 0 (UCX then
moves the KV by CUDA IPC, which no kernel shaping could hold: that is what pacing is
for); without CUDA, host memory (UCX shared memory / TCP). SmolLM2-135M-shaped caches
(30 layers, 3 KV heads, head_dim 64, fp32). First the unpaced ceiling, then each rate, all in
one pair of processes (launcher.emulation.kvprobe --plan: starting processes costs seconds, more
than a slow rate's transfers). Each rate's transfer is sized to take about ``--seconds`` at
that rate (at least ``--min-mb``, at most ``--max-mb``), after a warm-up that connects and
drains the bucket's burst, so the transfers start on an empty bucket.
Achieved = KV bytes / (first send_layer .. receiver's ACK), median of ``--transfers``; link =
the sender's link-bound rate (bytes it held back over its time on them, TransferResult
link_bytes / phase "link"). A set rate above ~90% of the unpaced ceiling is marked as not held.

    python -m benchmarks.bench_pacing [--device auto|cpu|cuda] [--rates 1 10 25 100] [--seconds 0.5]

At --seconds 0.5 and 3 transfers, six rates take about 3 x 0.5 s each plus the warm-ups (2 MB
each: 0.17 s at 0.1 Gbit/s) and one start of the two processes.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 10, 25, 100])
    parser.add_argument("--transfers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="target duration of one transfer")
    parser.add_argument("--min-mb", type=float, default=2.0, help="smallest transfer (MB)")
    parser.add_argument("--max-mb", type=float, default=2000.0, help="largest transfer (MB)")
    parser.add_argument("--ceiling-mb", type=float, default=None,
                        help="the unpaced transfer (MB; default 1000 on CUDA, 100 on CPU, at most --max-mb)")
    parser.add_argument("--burst", default=None, help="bucket depth, as a pacing spec writes it (e.g. 64KiB; "
                        "default: the spec's 1 MiB)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up on the probe after this")
    args = parser.parse_args(argv)
    if args.burst:
        from pdserve.kvtransfer.pacing_spec import parse_pacing

        try:
            parse_pacing(f"default=1,burst={args.burst}")
        except ValueError as e:
            parser.error(f"--burst: {e}")
    if args.transfers < 1 or args.seconds <= 0 or any(r <= 0 for r in args.rates) or \
            not 0 < args.min_mb <= args.max_mb:
        parser.error("--transfers, --seconds and --rates must be positive, and 0 < --min-mb <= --max-mb")

    import torch

    from pdserve.launcher.emulation.kvprobe import format_table, measure_plan, summarize, transfer_mb

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

    ceiling_mb = min(args.max_mb, args.ceiling_mb or (1000.0 if device == "cuda" else 100.0))
    plan = [(ceiling_mb, None)] + [
        (transfer_mb(rate, args.seconds, low=args.min_mb, high=args.max_mb),
         f"default={rate:g}" + (f",burst={args.burst}" if args.burst else "")) for rate in args.rates]
    start = time.monotonic()
    results = measure_plan(spawn, "127.0.0.1", plan, args.transfers, device=device, timeout_s=args.timeout_s)
    ceiling_row = summarize(None, "none (unpaced)", results[0])
    ceiling = ceiling_row["achieved_gbps"]
    rows = [ceiling_row] + [summarize(rate, "pacing", result, ceiling) for rate, result in zip(args.rates, results[1:])]
    print(f"({len(plan)} measurements in {time.monotonic() - start:.1f} s)\n")
    print(format_table(rows))
    print("\nachieved: sender side, first send_layer to ACK; recv: receiver side, first layer landed to last "
          "(excludes the first layer, so it reads high by ~1/30); link: the sender's link-bound rate (each "
          "message that was ready before the previous one was posted and waited for the bucket, from that post to "
          "its own); ratio = achieved / set.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
