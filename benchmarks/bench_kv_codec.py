"""The FP8 wire codec's speed (kernels.kv_quant.pack_blocks on the sender, unpack_blocks on the
receiver), in Gbit/s of full-precision KV: the figure the network-aware policy prices FP8 with
(router.placement.policies.cost.CODEC_GBPS).

    python benchmarks/bench_kv_codec.py [--device cpu|cuda] [--blocks 64 256] [--threads N] [--repeat 20]

Shape: SmolLM2-135M's KV blocks in float32 on the CPU (16 tokens, 3 KV heads, d64), Llama-3.1-8B's
in bf16 on CUDA (8 KV heads, d128). Median of --repeat after a warm-up; CUDA timed with a
synchronize around each call. Prints pack, unpack and the round trip (what one FP8 transfer costs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.kv_quant import pack_blocks, unpack_blocks  # noqa: E402

SHAPES = {"cpu": ((16, 3, 64), torch.float32), "cuda": ((16, 8, 128), torch.bfloat16)}


def timed(fn, device: str, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    if args.repeat < 1 or any(b < 1 for b in args.blocks):
        ap.error("--repeat and --blocks must be positive")
    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads must be positive")
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kv_codec: --device cuda requested but CUDA is not available; nothing measured.", file=sys.stderr)
        return 2
    (bs, hk, d), dtype = SHAPES[args.device]
    print(f"FP8 wire codec on {args.device} ({torch.get_num_threads()} threads), blocks of {bs} tokens x {hk} KV heads "
          f"x d{d}, {str(dtype).removeprefix('torch.')}; Gbit/s of full-precision KV, median of {args.repeat}")
    print(f"{'blocks':>7} {'KV MB':>7} {'pack ms':>8} {'unpack ms':>10} {'pack':>7} {'unpack':>7} {'round trip':>11}")
    for n in args.blocks:
        x = torch.randn(n, bs, hk, d, device=args.device).to(dtype)
        raw = pack_blocks(x)
        bits = x.numel() * x.element_size() * 8
        pack_s = timed(lambda: pack_blocks(x), args.device, args.repeat)
        unpack_s = timed(lambda: unpack_blocks(raw, dtype), args.device, args.repeat)
        print(f"{n:>7} {bits / 8e6:>7.2f} {pack_s * 1e3:>8.2f} {unpack_s * 1e3:>10.2f} {bits / pack_s / 1e9:>7.2f} "
              f"{bits / unpack_s / 1e9:>7.2f} {bits / (pack_s + unpack_s) / 1e9:>11.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
