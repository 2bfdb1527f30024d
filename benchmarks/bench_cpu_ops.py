"""The CPU decode path's two big costs, side by side, on a model's real shapes (fp32).

    python -m benchmarks.bench_cpu_ops [--model smollm2-135m] [--rows 1 2 4 8 16] [--context 170]

1. The layer stack's projections (QKV, O, gate/up, down, every layer) and the LM head, with
   dense weights (`torch.nn.functional.linear`) and with MKL-packed weights
   (`pdserve.kernels.linear` over `kernels.PackedWeight`), at each batch size M in ``--rows``.
2. Decode attention of every layer at batch 16 over a paged cache (random block tables,
   contexts up to ``--context``): gather + SDPA eager, the same compiled, and the gather-free
   form `torch.compile` runs (`decode_attention_planned(gather_free=True)`).

Each figure is the median of ``--reps`` passes, the variants alternating within a pass so
machine drift hits them alike; ratios are dense / packed and SDPA / gather-free.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from pdserve import kernels
from pdserve.loaders.random_weights import RANDOM_SHAPES


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_linear(c, rows: list[int], reps: int) -> None:
    h, q, kv, ff = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    shapes = [("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * ff, h), ("down", h, ff)]
    g = torch.Generator().manual_seed(0)
    dense = [[torch.randn(n, k, generator=g) * 0.02 for _, n, k in shapes] for _ in range(c.num_layers)]
    packed = [[kernels.PackedWeight(w) for w in layer] for layer in dense]
    head = torch.randn(c.vocab_size, h, generator=g) * 0.02
    head_packed = kernels.PackedWeight(head)
    mib = sum(n * k for _, n, k in shapes) * c.num_layers * 4 / 2**20
    print(f"projections of {c.num_layers} layers ({mib:.0f} MiB)"
          f" and LM head ({c.vocab_size} x {h}), ms per pass, median of {reps}")
    print(f"{'M':>4}{'layers dense':>14}{'packed':>9}{'ratio':>7}{'head dense':>12}{'packed':>9}{'ratio':>7}")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for _, _, k in shapes}
        x_head = torch.randn(m, h, generator=g)

        def stack(weights):
            for layer in weights:
                for (_, _, k), w in zip(shapes, layer):
                    kernels.linear(xs[k], w)

        runs: dict[str, list[float]] = {"ld": [], "lp": [], "hd": [], "hp": []}
        stack(dense), stack(packed)  # warm
        for _ in range(reps):
            runs["ld"].append(timed(lambda: stack(dense)))
            runs["lp"].append(timed(lambda: stack(packed)))
            runs["hd"].append(timed(lambda: kernels.linear(x_head, head)))
            runs["hp"].append(timed(lambda: kernels.linear(x_head, head_packed)))
        ld, lp, hd, hp = (statistics.median(runs[k]) * 1e3 for k in ("ld", "lp", "hd", "hp"))
        print(f"{m:>4}{ld:>14.2f}{lp:>9.2f}{ld / lp:>6.2f}x{hd:>12.2f}{hp:>9.2f}{hd / hp:>6.2f}x")


def bench_attention(c, context: int, reps: int, batch: int = 16, block_size: int = 16) -> None:
    hk, d, hq = c.num_kv_heads, c.head_dim, c.num_heads
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq * 4  # a pool bigger than the batch needs, blocks scattered
    g = torch.Generator().manual_seed(1)
    caches = [(torch.randn(num_blocks, block_size, hk, d, generator=g),
               torch.randn(num_blocks, block_size, hk, d, generator=g)) for _ in range(c.num_layers)]
    tables = torch.randperm(num_blocks, generator=g)[: batch * blocks_per_seq].view(batch, blocks_per_seq).int()
    seq_lens = torch.randint(context * 2 // 3, context + 1, (batch,), generator=g).int()
    seq_lens[0] = context
    plan = kernels.decode_gather_plan(tables, seq_lens, block_size)
    q = torch.randn(batch, hq, d, generator=g)
    scale = d ** -0.5

    def layers(gather_free: bool):
        def run(q, slots, mask):
            return torch.stack([kernels.decode_attention_planned(q, k, v, (slots, mask, plan[2]), scale,
                                                                 gather_free=gather_free) for k, v in caches])
        return run

    variants = {"gather + SDPA, eager": layers(False), "gather + SDPA, compiled": torch.compile(layers(False)),
                "gather-free, compiled": torch.compile(layers(True))}
    expected = variants["gather + SDPA, eager"](q, plan[0], plan[1])
    for name, fn in variants.items():
        err = (fn(q, plan[0], plan[1]) - expected).abs().max().item()  # also compiles
        if err > 1e-4:
            raise SystemExit(f"{name} differs from SDPA by {err}")
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            runs[name].append(timed(lambda: fn(q, plan[0], plan[1])))
    med = {name: statistics.median(r) * 1e3 for name, r in runs.items()}
    print(f"\ndecode attention, {c.num_layers} layers, batch {batch}, contexts {int(seq_lens.min())}-{context} "
          f"tokens, Hq={hq} Hk={hk} D={d}, ms per pass, median of {reps}")
    base = med["gather + SDPA, eager"]
    for name, ms in med.items():
        print(f"  {name:<26}{ms:8.2f}   {base / ms:5.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", choices=sorted(RANDOM_SHAPES), help="a random:<name> shape")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--context", type=int, default=170)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    if any(m < 1 for m in args.rows):
        p.error("--rows must be positive")
    if args.context < 1 or args.reps < 1:
        p.error("--context and --reps must be positive")
    if not kernels.packing_available():
        print("this torch build has no MKL packed GEMM", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    c = RANDOM_SHAPES[args.model]
    print(f"{args.model}, fp32, {args.threads} threads, torch {torch.__version__}")
    bench_linear(c, args.rows, args.reps)
    bench_attention(c, args.context, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
