"""Benchmark the attention kernels on CUDA.

Decode: achieved HBM bandwidth of `decode_attention` (bytes of K/V read plus q and out) at
batch x context, 32 query heads / 8 kv heads / head_dim 128 / bf16, as a fraction of the
device-to-device copy bandwidth measured in the same run.
Prefill: causal TFLOP/s of `prefill_attention` (one sequence, d128) against torch SDPA with
the flash backend, in the same run.

    python benchmarks/bench_kernels.py [--block-size 16] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 16, 64, 256)
CONTEXTS = (1024, 4096, 16384, 32768)
PREFILL_TOKENS = (1024, 2048, 4096, 8192, 16384)


def copy_bandwidth(do_bench) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    del src, dst
    return 2 * (1 << 30) / (ms * 1e-3)


def paged_cache(batch: int, context: int, block_size: int):
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device="cuda").normal_()
    v_cache = torch.empty(shape, dtype=DTYPE, device="cuda").normal_()
    block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int64)
    block_tables = block_tables.to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, block_tables, seq_lens


def bench_decode(do_bench, block_size: int, copy_bw: float, batches, contexts) -> list[str]:
    from kernels.decode_attention import decode_attention_triton

    rows = []
    element = torch.finfo(DTYPE).bits // 8
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * element
            free, _ = torch.cuda.mem_get_info()
            if kv_bytes * 1.1 + (1 << 30) > free:
                rows.append(f"{batch:>6} {context:>8} {'skipped: KV cache does not fit':>40}")
                continue
            k_cache, v_cache, block_tables, seq_lens = paged_cache(batch, context, block_size)
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
            scale = 1 / math.sqrt(HEAD_DIM)
            fn = lambda: decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale)  # noqa: E731
            ms = do_bench(fn, warmup=10, rep=50)
            moved = kv_bytes + 2 * q.numel() * element
            bw = moved / (ms * 1e-3)
            rows.append(f"{batch:>6} {context:>8} {ms * 1e3:>12.1f} {bw / 1e9:>12.0f} {bw / copy_bw:>14.2f}")
            del k_cache, v_cache, block_tables, seq_lens, q
            torch.cuda.empty_cache()
    return rows


def bench_prefill(do_bench, block_size: int, token_counts) -> list[str]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.prefill_attention import prefill_attention_triton

    rows = []
    scale = 1 / math.sqrt(HEAD_DIM)
    for tokens in token_counts:
        k_cache, v_cache, block_tables, seq_lens = paged_cache(1, tokens, block_size)
        q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
        flops = 4 * tokens * tokens * NUM_HEADS * HEAD_DIM / 2  # causal: half the matrix
        ours = do_bench(lambda: prefill_attention_triton(q, k_cache, v_cache, block_tables, cu,
                                                         seq_lens, scale), warmup=10, rep=50)
        # Dense, unpaged copies for SDPA; GQA expanded up front (flash needs equal heads).
        order = block_tables[0].long()
        k = k_cache[order].flatten(0, 1)[:tokens].transpose(0, 1)
        v = v_cache[order].flatten(0, 1)[:tokens].transpose(0, 1)
        group = NUM_HEADS // NUM_KV_HEADS
        k = k.repeat_interleave(group, 0)[None].contiguous()
        v = v.repeat_interleave(group, 0)[None].contiguous()
        qd = q.transpose(0, 1)[None].contiguous()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa = do_bench(lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=scale),
                            warmup=10, rep=50)
        rows.append(f"{tokens:>8} {ours * 1e3:>12.1f} {flops / ours / 1e9:>10.1f} "
                    f"{sdpa * 1e3:>12.1f} {flops / sdpa / 1e9:>10.1f} {sdpa / ours:>10.2f}")
        del k_cache, v_cache, q, k, v, qd
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a few configurations only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    try:
        import triton
        from triton.testing import do_bench
    except ImportError:
        sys.exit("bench_kernels.py needs the triton package (pip install 'pdserve[triton]')")

    batches, contexts, token_counts = BATCHES, CONTEXTS, PREFILL_TOKENS
    if args.quick:
        batches, contexts, token_counts = (1, 64), (4096,), (1024, 4096)
    name = torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"block size {args.block_size}")
    copy_bw = copy_bandwidth(do_bench)
    print(f"device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s\n")

    print(f"decode attention, Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} bf16")
    print(f"{'batch':>6} {'context':>8} {'time (us)':>12} {'GB/s':>12} {'of copy bw':>14}")
    for row in bench_decode(do_bench, args.block_size, copy_bw, batches, contexts):
        print(row, flush=True)

    print(f"\nprefill attention, causal, one sequence, Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} bf16")
    print(f"{'tokens':>8} {'ours (us)':>12} {'TFLOP/s':>10} {'sdpa (us)':>12} {'TFLOP/s':>10} {'speedup':>10}")
    for row in bench_prefill(do_bench, args.block_size, token_counts):
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
