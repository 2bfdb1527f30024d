"""Benchmark the attention kernels on CUDA.

Decode: achieved HBM bandwidth of `decode_attention` (bytes of K/V read plus q and out) at
batch x context, 32 query heads / 8 kv heads / head_dim 128 / bf16, as a fraction of the
device-to-device copy bandwidth measured in the same run.
Prefill: causal TFLOP/s of `prefill_attention` (one sequence, d128) against torch SDPA with
the flash backend, in the same run. `--sweep` also times other tile configurations of both
kernels (the defaults live in pdserve/kernels/prefill_attention.py and pdserve/kernels/decode_attention.py).

    python -m benchmarks.bench_kernels [--block-sizes 16,32] [--quick] [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
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
    src = dst = None  # freed (not del: the lambdas above close over them)
    return 2 * (1 << 30) / (ms * 1e-3)


def gpu_time(fn) -> float:
    """Milliseconds of GPU time per call, replayed from a CUDA graph so that host launch
    overhead (what the engine's decode graphs remove) does not count."""
    from triton.testing import do_bench_cudagraph

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=50)


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


def bench_decode(do_bench, block_size: int, copy_bw: float, batches, contexts,
                 config=None) -> list[dict]:
    from pdserve.kernels.decode_attention import decode_attention_triton

    rows = []
    element = torch.finfo(DTYPE).bits // 8
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * element
            free, _ = torch.cuda.mem_get_info()
            if kv_bytes * 1.1 + (1 << 30) > free:
                rows.append(dict(block_size=block_size, batch=batch, context=context, skipped=True))
                continue
            k_cache, v_cache, block_tables, seq_lens = paged_cache(batch, context, block_size)
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
            scale = 1 / math.sqrt(HEAD_DIM)
            fn = lambda: decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale,  # noqa: E731
                                                 config=config)
            ms = gpu_time(fn)
            moved = kv_bytes + 2 * q.numel() * element
            bw = moved / (ms * 1e-3)
            rows.append(dict(block_size=block_size, batch=batch, context=context, us=ms * 1e3,
                             gb_s=bw / 1e9, of_copy_bw=bw / copy_bw, config=config))
            k_cache = v_cache = block_tables = seq_lens = q = None  # freed (not del: the lambdas above close over them)
            torch.cuda.empty_cache()
    return rows


def bench_prefill(do_bench, block_size: int, token_counts, configs=(None,)) -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pdserve.kernels.prefill_attention import prefill_attention_triton, prefill_config

    rows = []
    scale = 1 / math.sqrt(HEAD_DIM)
    for tokens in token_counts:
        k_cache, v_cache, block_tables, seq_lens = paged_cache(1, tokens, block_size)
        q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
        flops = 4 * tokens * tokens * NUM_HEADS * HEAD_DIM / 2  # causal: half the matrix
        # Dense, unpaged copies for SDPA; GQA expanded up front (flash needs equal heads).
        order = block_tables[0].long()
        k = k_cache[order].flatten(0, 1)[:tokens].transpose(0, 1)
        v = v_cache[order].flatten(0, 1)[:tokens].transpose(0, 1)
        group = NUM_HEADS // NUM_KV_HEADS
        k = k.repeat_interleave(group, 0)[None].contiguous()
        v = v.repeat_interleave(group, 0)[None].contiguous()
        qd = q.transpose(0, 1)[None].contiguous()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            want = F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=scale)
            sdpa = gpu_time(lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=scale))
        for config in configs:
            fn = lambda: prefill_attention_triton(q, k_cache, v_cache, block_tables, cu,  # noqa: E731
                                                  seq_lens, scale, config=config)
            try:
                got = fn()
                err = (got.transpose(0, 1)[None].float() - want.float()).abs().max().item()
                ours = gpu_time(fn)
            except Exception as exc:  # a config that does not compile (shared memory, ...)
                rows.append(dict(tokens=tokens, config=config, error=f"{type(exc).__name__}: {exc}"[:200]))
                continue
            rows.append(dict(tokens=tokens, config=list(config or prefill_config(HEAD_DIM, True, tokens)),
                             default=config is None, ours_us=ours * 1e3, ours_tflops=flops / ours / 1e9,
                             sdpa_us=sdpa * 1e3, sdpa_tflops=flops / sdpa / 1e9, speedup=sdpa / ours,
                             max_abs_err=err))
        k_cache = v_cache = q = k = v = qd = None  # freed (not del: the lambdas above close over them)
        torch.cuda.empty_cache()
    return rows


def bench_prefill_paths(token_counts, dense_configs=(None,), seqs: int = 1) -> list[dict]:
    """Fresh prompts (no cached prefix): the paged kernel, the dense kernel over the step's own
    K/V (TMA and plain loads) and torch SDPA's backends, each on `seqs` sequences of `tokens`
    tokens. K and V are strided views of one QKV tensor, as the model hands them over."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pdserve.kernels.prefill_attention import prefill_attention_triton
    from pdserve.kernels.prefill_attention_dense import dense_prefill_attention_triton

    rows = []
    scale = 1 / math.sqrt(HEAD_DIM)
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    group = NUM_HEADS // NUM_KV_HEADS
    for tokens in token_counts:
        t = tokens * seqs
        qkv = torch.randn(t, q_size + 2 * kv_size, dtype=DTYPE, device="cuda")
        q = qkv[:, :q_size].reshape(t, NUM_HEADS, HEAD_DIM).contiguous()
        k = qkv[:, q_size:q_size + kv_size].view(t, NUM_KV_HEADS, HEAD_DIM)
        v = qkv[:, q_size + kv_size:].view(t, NUM_KV_HEADS, HEAD_DIM)
        cu = torch.arange(0, t + 1, tokens, dtype=torch.int32, device="cuda")
        flops = seqs * 4 * tokens * tokens * NUM_HEADS * HEAD_DIM / 2
        # The paged layout: 16-token blocks in a shuffled order, the same K/V.
        block_size = 16
        nblk = t // block_size
        order = torch.randperm(nblk, device="cuda")
        k_cache = torch.empty(nblk, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        v_cache = torch.empty_like(k_cache)
        k_cache[order] = k.reshape(nblk, block_size, NUM_KV_HEADS, HEAD_DIM)
        v_cache[order] = v.reshape(nblk, block_size, NUM_KV_HEADS, HEAD_DIM)
        tables = order.to(torch.int32).view(seqs, tokens // block_size)
        seq_lens = torch.full((seqs,), tokens, dtype=torch.int32, device="cuda")
        qd = q.view(seqs, tokens, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        kd = k.reshape(seqs, tokens, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        vd = v.reshape(seqs, tokens, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        kd = kd.repeat_interleave(group, 1).contiguous()
        vd = vd.repeat_interleave(group, 1).contiguous()
        want = F.scaled_dot_product_attention(qd.float(), kd.float(), vd.float(), is_causal=True, scale=scale)
        want = want.transpose(1, 2).reshape(t, NUM_HEADS, HEAD_DIM)

        paths = [("paged", None, lambda: prefill_attention_triton(q, k_cache, v_cache, tables, cu, seq_lens, scale)),
                 ("dense", None, lambda: dense_prefill_attention_triton(q, k, v, cu, scale, max_len=tokens, tma=False))]
        for config in dense_configs:
            paths.append(("dense-tma", config,
                          lambda c=config: dense_prefill_attention_triton(q, k, v, cu, scale, config=c,
                                                                          max_len=tokens)))
        for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
            def run(b=backend):
                with sdpa_kernel(b):
                    return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
            paths.append((name, None, run))
        for name, config, fn in paths:
            try:
                got = fn()
                if got.dim() == 4:
                    got = got.transpose(1, 2).reshape(t, NUM_HEADS, HEAD_DIM)
                err = (got.float() - want).abs().max().item()
                if name.startswith("sdpa"):  # cuDNN may refuse graph capture: plain events
                    from triton.testing import do_bench
                    us = do_bench(fn, warmup=10, rep=50) * 1e3
                else:
                    us = gpu_time(fn) * 1e3
            except Exception as exc:  # a backend or config that does not run here
                rows.append(dict(tokens=tokens, seqs=seqs, path=name, config=config,
                                 error=f"{type(exc).__name__}: {exc}"[:200]))
                print(f"{seqs:>4} x {tokens:>6} {name:>15}  {config}: {rows[-1]['error']}", flush=True)
                continue
            rows.append(dict(tokens=tokens, seqs=seqs, path=name, config=config, us=us,
                             tflops=flops / us / 1e6, max_abs_err=err))
            print(f"{seqs:>4} x {tokens:>6} {name:>15} {us:>10.1f} us {flops / us / 1e6:>7.1f} TFLOP/s "
                  f"err {err:.4f}  {config or 'default'}", flush=True)
        qkv = q = k_cache = v_cache = qd = kd = vd = want = None  # freed (not del: the lambdas above close over them)
        torch.cuda.empty_cache()
    return rows


MATMUL_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                 "lm_head": (128256, 4096)}  # Llama-3.1-8B's projections, [N, K]
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")


def bench_skinny(copy_bw: float, matmul_flops: float, rows=(1, 16, 64, 128, 256, 512)) -> list[dict]:
    """x[M, K] @ w[N, K]^T at decode batch sizes through cuBLAS two ways: F.linear, and the
    operands swapped (w @ x^T, then transposed back), which hands cuBLAS the long side as its
    M. Each against the larger of its weight read at the copy bandwidth and its FLOPs at the
    square matmul rate; and summed over one 8B decode step (32 layers + the LM head)."""
    import torch.nn.functional as F

    out = []
    for m in rows:
        step: dict[str, float] = {}
        bound_step = 0.0
        for name, (n, k) in MATMUL_SHAPES.items():
            w = torch.randn(n, k, dtype=DTYPE, device="cuda") * 0.02
            x = torch.randn(m, k, dtype=DTYPE, device="cuda")
            want = F.linear(x, w).float()
            count = 32 if name in LAYER_SHAPES else 1
            bound = max(n * k * 2 / copy_bw, 2 * m * n * k / matmul_flops) * 1e6  # us
            bound_step += count * bound
            for label, fn in (("linear", lambda: F.linear(x, w)),
                              ("swapped", lambda: torch.mm(w, x.t()).t().contiguous()),
                              ("swapped-noncontig", lambda: torch.mm(w, x.t()).t())):
                err = (fn().float() - want).abs().max().item()
                us = gpu_time(fn) * 1e3
                step[label] = step.get(label, 0.0) + count * us
                out.append(dict(rows=m, shape=name, path=label, us=us, of_bound=bound / us, max_abs_err=err))
                print(f"M={m:>4} {name:>8} {label:>18} {us:>9.1f} us {bound / us:>6.3f} of bound  err {err:.4f}",
                      flush=True)
            w = x = None  # freed (not del: the lambdas above close over them)
        for label, us in step.items():
            print(f"M={m:>4} one 8B step's projections {label:>18}: {us / 1e3:.3f} ms, {bound_step / us:.3f} of "
                  f"bound ({step['linear'] / us:.3f}x linear)", flush=True)
        out.append(dict(rows=m, step_us=step, bound_step_us=bound_step))
    return out


DENSE_SWEEP = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (64, 128, 4, 3), (64, 128, 8, 3),
               (64, 64, 8, 3), (64, 32, 4, 4), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2),
               (128, 64, 8, 4)]

PREFILL_SWEEP = [(128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 64, 4, 4), (128, 64, 4, 2),
                 (128, 128, 4, 2), (128, 128, 8, 4), (256, 64, 8, 3), (64, 64, 4, 3),
                 # Hopper (H100/H200): two warpgroups over 128 rows, deeper pipelines on 228 KB of smem
                 (128, 64, 8, 4), (128, 64, 8, 5), (128, 128, 8, 5), (256, 128, 8, 2), (256, 64, 8, 4)]
DECODE_SWEEP = [(64, 4, 2), (32, 4, 3), (32, 2, 4), (64, 4, 4), (64, 8, 3)]


def print_decode(rows: list[dict]) -> None:
    print(f"{'bs':>4} {'batch':>6} {'context':>8} {'time (us)':>12} {'GB/s':>10} {'of copy bw':>12}  config")
    for r in rows:
        if r.get("skipped"):
            print(f"{r['block_size']:>4} {r['batch']:>6} {r['context']:>8}  skipped: KV cache does not fit")
        else:
            print(f"{r['block_size']:>4} {r['batch']:>6} {r['context']:>8} {r['us']:>12.1f} {r['gb_s']:>10.0f} "
                  f"{r['of_copy_bw']:>12.2f}  {r['config'] or 'default'}", flush=True)


def print_prefill(rows: list[dict]) -> None:
    print(f"{'tokens':>8} {'ours (us)':>12} {'TFLOP/s':>9} {'sdpa (us)':>12} {'TFLOP/s':>9} {'speedup':>8}"
          f" {'max err':>8}  config")
    for r in rows:
        if "error" in r:
            print(f"{r['tokens']:>8}  {r['config']}: {r['error']}")
            continue
        print(f"{r['tokens']:>8} {r['ours_us']:>12.1f} {r['ours_tflops']:>9.1f} {r['sdpa_us']:>12.1f} "
              f"{r['sdpa_tflops']:>9.1f} {r['speedup']:>8.2f} {r['max_abs_err']:>8.4f}  "
              f"{tuple(r['config'])}{' (default)' if r['default'] else ''}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-sizes", default="16,32", help="KV block sizes, comma-separated")
    parser.add_argument("--quick", action="store_true", help="a few configurations only")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configurations")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--paths", action="store_true",
                        help="fresh prompts: the paged and dense kernels against SDPA's backends")
    parser.add_argument("--skinny", action="store_true", help="decode-sized matmuls: cuBLAS two ways")
    parser.add_argument("--json", help="write every measured row here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    try:
        import triton
        from triton.testing import do_bench
    except ImportError:
        sys.exit("bench_kernels.py needs the triton package (pip install 'pdserve[triton]')")
    block_sizes = [int(b) for b in args.block_sizes.split(",")]

    batches, contexts, token_counts = BATCHES, CONTEXTS, PREFILL_TOKENS
    if args.quick:
        batches, contexts, token_counts = (1, 64), (4096,), (1024, 4096)
    name = torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")
    copy_bw = copy_bandwidth(do_bench)
    print(f"device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s\n")
    results: dict = {"gpu": name, "torch": torch.__version__, "triton": triton.__version__,
                     "copy_gb_s": copy_bw / 1e9, "decode": [], "prefill": []}

    if not args.skip_decode:
        print(f"decode attention, Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} bf16, block sizes {block_sizes}; "
              "GPU time from CUDA graph replay")
        for bs in block_sizes:
            rows = bench_decode(do_bench, bs, copy_bw, batches, contexts)
            print_decode(rows)
            results["decode"] += rows
        if args.sweep:
            print("\ndecode sweep (BLOCK_N, num_warps, num_stages), block size 16")
            for config in DECODE_SWEEP:
                rows = bench_decode(do_bench, 16, copy_bw, (1, 64), (4096, 32768), config)
                print_decode(rows)
                results["decode"] += rows

    if not args.skip_prefill:
        print(f"\nprefill attention, causal, one sequence, Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} bf16, "
              f"block size {block_sizes[0]}; speedup = sdpa time / ours (GPU time, CUDA graph replay)")
        configs = [None] + (PREFILL_SWEEP if args.sweep else [])
        rows = bench_prefill(do_bench, block_sizes[0], token_counts, configs)
        print_prefill(rows)
        results["prefill"] = rows
    if args.paths:
        print(f"\nprefill paths, fresh prompts, causal, Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} bf16; "
              "GPU time from CUDA graph replay")
        configs = [None] + (DENSE_SWEEP if args.sweep else [])
        results["paths"] = (bench_prefill_paths((2048, 8192), configs)
                            + bench_prefill_paths((2048,), configs, seqs=4)
                            + bench_prefill_paths((1024,), configs, seqs=8))
    if args.skinny:
        a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
        rate = 2 * 8192 ** 3 / (do_bench(lambda: a @ a, warmup=10, rep=50) * 1e-3)
        del a
        print("\ndecode-sized matmuls, bf16, GPU time from CUDA graph replay; "
              f"copy bandwidth {copy_bw / 1e9:.0f} GB/s, "
              f"matmul 8192^3 {rate / 1e12:.0f} TFLOP/s")
        results["skinny"] = bench_skinny(copy_bw, rate)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
