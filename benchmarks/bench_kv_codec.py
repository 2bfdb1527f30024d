"""The FP8 wire codec's speed (kernels.kv_codec.pack_blocks on the sender, unpack_blocks on the
receiver), in Gbit/s of full-precision KV: the figure the network-aware policy prices FP8 with
(router.placement.policies.cost.CODEC_GBPS).

    python -m benchmarks.bench_kv_codec [--device cpu|cuda] [--blocks N ...] [--threads N] [--repeat 20]

Shape: SmolLM2-135M's KV blocks in float32 on the CPU (16 tokens, 3 KV heads, d64), Llama-3.1-8B's
in bf16 on CUDA (8 KV heads, d128). Median of --repeat after a warm-up; CUDA timed with a
synchronize around each call. Prints pack, unpack and the round trip (what one FP8 transfer costs).

On the CPU it times `pack_blocks` / `unpack_blocks` (the torch path there), --blocks 64 256 by
default. On CUDA it times the Triton kernels (kernels.kv_codec, what `pack_blocks` runs there) and
the torch reference (`pack_blocks_ref`) side by side, with the ratio torch / Triton, after checking
that they give the same bytes and values; --blocks 128 4096 by default: one layer of a 2k-token
prompt (what one layer message packs) and the whole prompt's blocks at once. The "host" columns are
the time the calling thread spends per call, back to back without a synchronize: what a codec
launched from the prefill's thread takes from it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pdserve.kernels.kv_codec import pack_blocks, unpack_blocks
from pdserve.kernels.kv_quant import pack_blocks_ref, unpack_blocks_ref

SHAPES = {"cpu": ((16, 3, 64), torch.float32), "cuda": ((16, 8, 128), torch.bfloat16)}
BLOCKS = {"cpu": [64, 256], "cuda": [128, 4096]}


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


def host_timed(fn, repeat: int) -> float:
    """Seconds of the calling thread per call, `repeat` calls back to back (CUDA: enqueue only)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / repeat


def bench_cuda(blocks: list[int], repeat: int) -> int:
    """The Triton kernels and the torch reference side by side, on CUDA."""
    from pdserve.kernels.kv_codec import pack_blocks_triton, unpack_blocks_triton

    (bs, hk, d), dtype = SHAPES["cuda"]
    paths = (("triton", pack_blocks_triton, unpack_blocks_triton), ("torch", pack_blocks_ref, unpack_blocks_ref))
    print(f"FP8 wire codec on cuda ({torch.cuda.get_device_name()}), blocks of {bs} tokens x {hk} KV heads x d{d}, "
          f"{str(dtype).removeprefix('torch.')}; Gbit/s of full-precision KV, median of {repeat}; "
          "host: ms of the calling thread per call")
    print(f"{'blocks':>7} {'KV MB':>7} {'path':>12} {'pack ms':>8} {'unpack ms':>10} {'host pack':>10} "
          f"{'host unpack':>12} {'pack':>7} {'unpack':>7} {'round trip':>11}")
    for n in blocks:
        x = torch.randn(n, bs, hk, d, device="cuda").to(dtype)
        raw = pack_blocks_ref(x)
        same = (torch.equal(pack_blocks_triton(x), raw)
                and torch.equal(unpack_blocks_triton(raw, dtype).view(torch.uint8),
                                unpack_blocks_ref(raw, dtype).view(torch.uint8)))
        bits = x.numel() * x.element_size() * 8
        got = {}
        for name, pack, unpack in paths:
            t = got[name] = (timed(lambda: pack(x), "cuda", repeat), timed(lambda: unpack(raw, dtype), "cuda", repeat),
                             host_timed(lambda: pack(x), repeat), host_timed(lambda: unpack(raw, dtype), repeat))
            print(f"{n:>7} {bits / 8e6:>7.2f} {name:>12} {t[0] * 1e3:>8.3f} {t[1] * 1e3:>10.3f} {t[2] * 1e3:>10.3f} "
                  f"{t[3] * 1e3:>12.3f} {bits / t[0] / 1e9:>7.1f} {bits / t[1] / 1e9:>7.1f} "
                  f"{bits / (t[0] + t[1]) / 1e9:>11.1f}", flush=True)
        fast, ref = got["triton"], got["torch"]
        ratio = [r / f for r, f in zip(ref, fast)]
        print(f"{n:>7} {'':>7} {'torch/triton':>12} {ratio[0]:>7.1f}x {ratio[1]:>9.1f}x {ratio[2]:>9.1f}x "
              f"{ratio[3]:>11.1f}x {'':>7} {'':>7} {(ref[0] + ref[1]) / (fast[0] + fast[1]):>10.1f}x"
              f"  same bytes and values: {'yes' if same else 'NO'}", flush=True)
        if not same:
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--blocks", type=int, nargs="+", default=None,
                    help="blocks per call (default: 64 256 on the CPU, 128 4096 on CUDA)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    if args.blocks is None:
        args.blocks = BLOCKS[args.device]
    if args.repeat < 1 or any(b < 1 for b in args.blocks):
        ap.error("--repeat and --blocks must be positive")
    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads must be positive")
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kv_codec: --device cuda requested but CUDA is not available; nothing measured.", file=sys.stderr)
        return 2
    if args.device == "cuda":
        return bench_cuda(args.blocks, args.repeat)
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
