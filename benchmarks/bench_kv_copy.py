"""What bounds moving KV blocks between two GPUs of one host: the block copy kernels, alone.

For a Llama-3.1-8B KV of ``--tokens`` tokens (32 layers, K and V, 16-token blocks of 32 KiB,
block ids drawn at random from twice as many), in one process with GPU 0 and GPU 1 (peer access
on), CUDA events around each op, median of ``--repeat``:

- ``gather`` / ``scatter``: the staged path's two local kernels (kernels.kv_copy) on GPU 0;
- ``pull``: the pool-to-pool kernel launched on GPU 1, reading GPU 0's pools over NVLink
  (what the KV transfer's pull path runs on the receiver);
- ``push``: the same kernel launched on GPU 0, writing GPU 1's pools;
- ``peer copy``: torch ``copy_`` of the same bytes, contiguous, GPU 0 -> GPU 1 (copy engine);
- ``local copy``: torch ``copy_`` of the same bytes on GPU 0.

    python -m benchmarks.bench_kv_copy [--tokens 2048 8192] [--repeat 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from pdserve.kernels.kv_copy import copy_blocks, gather_blocks, scatter_blocks

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def timed(fn, device, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(device):
            start.record()
            fn()
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("bench_kv_copy: needs two CUDA GPUs; nothing measured.", file=sys.stderr)
        return 2
    if not torch.cuda.can_device_access_peer(0, 1) or not torch.cuda.can_device_access_peer(1, 0):
        print("bench_kv_copy: GPU 0 and GPU 1 have no peer access; nothing measured.", file=sys.stderr)
        return 2
    print(f"KV block copies, Llama-3.1-8B shape, bf16, {torch.cuda.get_device_name(0)} x2; GB/s = 1e9 bytes/s, "
          f"bytes moved once; median of {args.repeat}\n")
    print(f"{'tokens':>7} {'KV MB':>7} {'gather':>8} {'scatter':>8} {'pull':>8} {'push':>8} {'peer copy':>10} "
          f"{'local copy':>11}")
    for tokens in args.tokens:
        n = -(-tokens // BLOCK)
        nb = 2 * n
        gen = torch.Generator().manual_seed(tokens)
        si = torch.randperm(nb, generator=gen)[:n]
        di = torch.randperm(nb, generator=gen)[:n]
        a = torch.randn(2 * LAYERS, nb, BLOCK * HEADS * HEAD_DIM, device="cuda:0").to(torch.bfloat16)
        b = torch.zeros(2 * LAYERS, nb, BLOCK * HEADS * HEAD_DIM, dtype=torch.bfloat16, device="cuda:1")
        staged = torch.empty(2 * LAYERS, n, a.shape[2], dtype=a.dtype, device="cuda:0")
        nbytes = staged.numel() * staged.element_size()
        flat0 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        flat1 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        flat0b = torch.empty_like(flat0)
        flat1.copy_(flat0)  # enables peer access both ways (torch does it on the first peer copy)
        flat0.copy_(flat1)
        si0, di0, si1, di1 = si.to("cuda:0"), di.to("cuda:0"), si.to("cuda:1"), di.to("cuda:1")
        t = {
            "gather": timed(lambda: gather_blocks(a, si0, staged), 0, args.repeat),
            "scatter": timed(lambda: scatter_blocks(a, di0, staged), 0, args.repeat),
            "pull": timed(lambda: copy_blocks(a, si1, b, di1), 1, args.repeat),
            "push": timed(lambda: copy_blocks(a, si0, b, di0), 0, args.repeat),
            "peer": timed(lambda: flat1.copy_(flat0), 0, args.repeat),
            "local": timed(lambda: flat0b.copy_(flat0), 0, args.repeat),
        }
        copy_blocks(a, si1, b, di1)
        torch.cuda.synchronize(1)
        if not torch.equal(b[:, di1].cpu(), a[:, si0].cpu()):
            raise RuntimeError("pull copy landed the wrong bytes")
        g = {k: nbytes / v / 1e9 for k, v in t.items()}
        print(f"{tokens:>7} {nbytes / 1e6:>7.1f} {g['gather']:>8.1f} {g['scatter']:>8.1f} {g['pull']:>8.1f} "
              f"{g['push']:>8.1f} {g['peer']:>10.1f} {g['local']:>11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
