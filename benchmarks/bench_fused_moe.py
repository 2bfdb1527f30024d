"""Benchmark the fused MoE MLP (pdserve.kernels.fused_moe) on CUDA.

For the expert shapes of Mixtral-8x7B, Qwen3-30B-A3B and OLMoE-1B-7B (hidden size, expert
intermediate size, experts, top-k from their published configs), bf16, at decode batches and one
prefill, the Triton path's time against
  (a) the active-weight roofline: the bytes of the experts the batch's routing touches, read once,
      over the device-to-device copy bandwidth measured in the same run (bytes read + written);
  (b) the torch reference, a loop of per-expert matmuls (`fused_moe_ref`).
Triton times are CUDA-graph replays, as the engine's decode graphs run it; the reference syncs on
its routing and is timed with events. Every timed call runs over enough layers' weights (each its
own copy) that the weights cannot come from L2; times are per layer. `--sweep` also times other
tile configurations (the defaults live in `moe_config`).

    python -m benchmarks.bench_fused_moe [--models mixtral-8x7b,qwen3-30b-a3b,olmoe-1b-7b]
        [--batches 1,16,64,256] [--prefill 2048] [--sweep] [--json out.json]
    python -m benchmarks.bench_fused_moe --device cpu --tiny   # the reference only, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from pdserve.kernels.fused_moe import MoEConfig, fused_moe_ref, moe_config, moe_route


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    inter: int
    experts: int
    top_k: int

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.inter  # gate, up and down


MODELS = {
    "mixtral-8x7b": MoEShape(hidden=4096, inter=14336, experts=8, top_k=2),
    "qwen3-30b-a3b": MoEShape(hidden=2048, inter=768, experts=128, top_k=8),
    "olmoe-1b-7b": MoEShape(hidden=2048, inter=1024, experts=64, top_k=8),
}
TINY = {
    "tiny-8x2": MoEShape(hidden=64, inter=96, experts=8, top_k=2),
    "tiny-16x4": MoEShape(hidden=32, inter=48, experts=16, top_k=4),
}
BATCHES = (1, 16, 64, 256)
PREFILL = 2048
TINY_BATCHES, TINY_PREFILL = (1, 4), 32
LAYER_BYTES = 2 << 30  # weights each timed call walks through, at least: several times any L2

SWEEP = [MoEConfig(16, 64, 128, 8, 4, 4), MoEConfig(16, 128, 128, 8, 4, 3), MoEConfig(16, 64, 256, 8, 4, 3),
         MoEConfig(32, 64, 128, 8, 4, 4), MoEConfig(32, 128, 64, 8, 4, 4), MoEConfig(64, 64, 64, 8, 4, 4),
         MoEConfig(64, 128, 64, 8, 8, 3), MoEConfig(64, 256, 64, 8, 8, 3), MoEConfig(128, 64, 64, 8, 8, 3),
         MoEConfig(128, 128, 64, 8, 8, 3), MoEConfig(128, 128, 64, 8, 8, 4), MoEConfig(128, 128, 64, 16, 8, 3),
         MoEConfig(128, 128, 128, 8, 8, 2), MoEConfig(128, 256, 64, 8, 8, 3), MoEConfig(256, 128, 64, 8, 8, 3)]


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), the roofline's denominator."""
    size = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = time_ms(device, lambda: dst.copy_(src)) * 1e-3
    return 2 * size / seconds


def time_ms(device: torch.device, fn, graph: bool = False) -> float:
    """Milliseconds a call: CUDA-graph replays (`graph`), CUDA events, or the CPU's clock."""
    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        fn()  # compile outside the capture and the timing
        torch.cuda.synchronize()
        if graph:
            return do_bench_cudagraph(fn, rep=50, return_mode="median")
        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def make_layers(shape: MoEShape, dtype: torch.dtype, device: torch.device, tiny: bool):
    layer_bytes = shape.experts * shape.expert_params * torch.finfo(dtype).bits // 8
    count = 1 if tiny else max(1, min(8, math.ceil(LAYER_BYTES / layer_bytes)))
    gen = torch.Generator(device=device).manual_seed(0)
    layers = []
    for _ in range(count):
        w13 = torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device=device, generator=gen, dtype=dtype)
        w2 = torch.randn(shape.experts, shape.hidden, shape.inter, device=device, generator=gen, dtype=dtype)
        layers.append((w13.mul_(shape.hidden ** -0.5), w2.mul_(shape.inter ** -0.5)))
    return layers


def bench_case(name: str, shape: MoEShape, tokens: int, layers, copy_bw: float, device: torch.device,
               use_triton: bool, configs=(None,)) -> list[dict]:
    dtype = layers[0][0].dtype
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, device=device, generator=gen).to(dtype)
    weights, ids = moe_route(torch.randn(tokens, shape.experts, device=device, generator=gen), shape.top_k, True)
    touched = torch.unique(ids).numel()
    active_bytes = touched * shape.expert_params * torch.finfo(dtype).bits // 8
    flops = 2 * tokens * shape.top_k * shape.expert_params
    roofline_us = active_bytes / copy_bw * 1e6
    per_layer = 1e3 / len(layers)  # ms for all layers -> us a layer

    ref_us = time_ms(device, lambda: [fused_moe_ref(x, w13, w2, weights, ids) for w13, w2 in layers]) * per_layer
    base = dict(model=name, tokens=tokens, experts_touched=touched, active_mb=active_bytes / 1e6,
                roofline_us=roofline_us, ref_us=ref_us, layers=len(layers), **asdict(shape))
    if not use_triton:
        return [dict(base, config=None)]

    from pdserve.kernels.fused_moe import fused_moe_triton

    want = fused_moe_ref(x, *layers[0], weights, ids).float()
    rows = []
    for config in configs:
        def run(c=config):
            return [fused_moe_triton(x, w13, w2, weights, ids, config=c) for w13, w2 in layers]
        try:
            got = run()[0].float()
            us = time_ms(device, run, graph=True) * per_layer
        except Exception as exc:  # a config that does not compile here (shared memory, ...)
            error = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(dict(base, config=asdict(config) if config else None, error=error))
            continue
        used = config or moe_config(tokens * shape.top_k, shape.experts)
        rows.append(dict(base, config=asdict(used), default=config is None, triton_us=us,
                         of_roofline=roofline_us / us, speedup=ref_us / us, tflops=flops / us / 1e6,
                         rel_err=((got - want).norm() / want.norm()).item()))
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'model':>14} {'tokens':>6} {'experts':>7} {'active MB':>9} {'roofline':>9} {'triton':>9} {'of roof':>7} "
          f"{'ref':>10} {'ref/triton':>10} {'TFLOP/s':>7} {'rel err':>8}  tiles (m, n, k, group, warps, stages)")
    for r in rows:
        head = f"{r['model']:>14} {r['tokens']:>6} {r['experts_touched']:>7} {r['active_mb']:>9.1f} " \
               f"{r['roofline_us']:>8.1f}u"
        if "error" in r:
            print(f"{head}  {r['config']}: {r['error']}")
        elif "triton_us" not in r:
            print(f"{head} {'-':>9} {'-':>7} {r['ref_us']:>9.1f}u {'-':>10} {'-':>7} {'-':>8}  reference only")
        else:
            c = r["config"]
            tiles = (c["block_m"], c["block_n"], c["block_k"], c["group_m"], c["num_warps"], c["num_stages"])
            print(f"{head} {r['triton_us']:>8.1f}u {r['of_roofline']:>7.2f} {r['ref_us']:>9.1f}u "
                  f"{r['speedup']:>9.2f}x {r['tflops']:>7.1f} {r['rel_err']:>8.1e}  {tiles}"
                  f"{' (default)' if r.get('default') else ''}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (the Triton path and the reference) or cpu "
                        "(the reference only, with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny expert shapes and batches (a smoke run)")
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--batches", help="decode batches, comma-separated, '' for none (default: 1,16,64,256)")
    parser.add_argument("--prefill", type=int, help=f"prefill tokens, 0 for none (default: {PREFILL})")
    parser.add_argument("--sweep", action="store_true", help="also time the tile configurations of SWEEP")
    parser.add_argument("--json", help="write every measured row here")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_fused_moe needs a CUDA GPU for --device cuda; none is visible (try --device cpu --tiny)")
    if device.type == "cpu" and not args.tiny:
        sys.exit("on --device cpu only the reference runs, on --tiny shapes: add --tiny")
    use_triton = device.type == "cuda"
    if use_triton:
        try:
            import triton
        except ImportError:
            sys.exit("bench_fused_moe needs the triton package (pip install 'pdserve[triton]')")
    shapes = TINY if args.tiny else MODELS
    if args.models:
        unknown = [m for m in args.models.split(",") if m not in shapes]
        if unknown:
            sys.exit(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(shapes)}")
        shapes = {m: shapes[m] for m in args.models.split(",")}
    if args.batches is not None:
        batches = [int(b) for b in args.batches.split(",") if b]  # "" for the prefill alone
    else:
        batches = list(TINY_BATCHES if args.tiny else BATCHES)
    prefill = args.prefill if args.prefill is not None else (TINY_PREFILL if args.tiny else PREFILL)
    token_counts = batches + ([prefill] if prefill else [])
    dtype = torch.bfloat16 if use_triton else torch.float32

    gpu = torch.cuda.get_device_name() if use_triton else "cpu"
    versions = f"torch {torch.__version__}" + (f", triton {triton.__version__}" if use_triton else "")
    print(f"device: {gpu}, {versions}, {dtype}")
    copy_bw = copy_bandwidth(device)
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write); times in us a layer; of roof = roofline / "
          "triton; ref/triton = the per-expert loop's time over the Triton path's\n")
    results: dict = {"device": gpu, "torch": torch.__version__, "copy_gb_s": copy_bw / 1e9, "dtype": str(dtype),
                     "rows": []}
    if use_triton:
        results["triton"] = triton.__version__
    configs = [None] + (SWEEP if args.sweep else [])
    for name, shape in shapes.items():
        layers = make_layers(shape, dtype, device, args.tiny)
        rows = []
        for tokens in token_counts:
            rows += bench_case(name, shape, tokens, layers, copy_bw, device, use_triton, configs)
        print_rows(rows)
        if args.sweep:
            best = {}
            for r in rows:
                if "triton_us" in r and (r["tokens"] not in best or r["triton_us"] < best[r["tokens"]]["triton_us"]):
                    best[r["tokens"]] = r
            print(f"best tiles of {name}:")
            print_rows(list(best.values()))
        print()
        results["rows"] += rows
        del layers
        if use_triton:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
