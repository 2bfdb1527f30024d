"""Steps with prefill rows, eager against piecewise CUDA graphs (--prefill-graphs), in one process.

    python3 -m benchmarks.bench_prefill_graphs [--model random:llama-3.1-8b] [--max-tokens 512]
        [--prompts 16 64 128 256 512] [--batches 1 16 64] [--chunks 64 128 256 512] [--context 1024]

One engine with the prefill graphs captured (pdserve/piecewise_graphs.py); each point is measured
with them on and off in turn (the order alternates point by point), by `pdserve profile`'s own
timers (pdserve/launcher/profile.py): a prompt's time to its first token on an idle engine (median of
`--repeats` after a warm-up run), and a mixed step of B decodes at `--context` plus a T-token chunk
(median of `--decode-steps`). Prints both and the ratio eager / graphs, and checks that each mode
ran the path it names (graph runs counted). Beside each, the host's part: the median time the
runner's `execute` took to return for that step's size, before anything waits for the GPU (the
launches; what overlapping such steps with the previous one's GPU work could hide). Off CUDA the
segments run eagerly (no capture): the figures are then the padding's cost, not the launches saved.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: random:llama-3.1-8b on CUDA, random:tiny-llama on CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--max-tokens", type=int, default=512, help="the graphs' largest step (tokens)")
    p.add_argument("--prompts", type=int, nargs="*", default=[16, 64, 128, 256, 512])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--chunks", type=int, nargs="*", default=[64, 128, 256, 512])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0, help="the random prompts (new ones for every run you compare)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: the memory budget)")
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if any(n < 1 for n in args.prompts + args.batches + args.chunks) or args.context < 1:
        p.error("--prompts, --batches, --chunks and --context take positive integers")

    import torch

    from pdserve.launcher.profile import Profiler
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_prefill_graphs: --device cuda needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    model = args.model or ("random:llama-3.1-8b" if device == "cuda" else "random:tiny-llama")
    budget = max([args.max_tokens, *args.prompts, *(b + t for b in args.batches for t in args.chunks)])
    try:
        config = EngineConfig(model=model, device=device, dtype=args.dtype, seed=args.seed,
                              cache=CacheConfig(prefill_graphs=True, prefill_graph_max_tokens=args.max_tokens,
                                                num_blocks=args.num_blocks),
                              scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                                        max_num_seqs=max(args.batches, default=1) + 1))
        profiler = Profiler(config, repeats=args.repeats, decode_steps=args.decode_steps, seed=args.seed,
                            progress=False)
    except (ValueError, FileNotFoundError) as exc:  # a bad --model or --num-blocks
        print(f"bench_prefill_graphs: error: {exc}", file=sys.stderr)
        return 2
    runner = profiler.engine.runner
    execute_calls: list[tuple[int, float]] = []  # (tokens in the step, seconds execute took to return)
    execute = runner.execute

    def timed_execute(batch, *a, **kw):
        t0 = time.perf_counter()
        out = execute(batch, *a, **kw)
        execute_calls.append((sum(batch.num_new_tokens), time.perf_counter() - t0))
        return out

    runner.execute = timed_execute  # the engine calls self.runner.execute: this instance's
    if device != "cuda":
        runner.prefill_graph_max_tokens = args.max_tokens  # off CUDA: the segments, eagerly
    if not runner.prefill_graph_max_tokens:
        print("the prefill graphs are off on this engine (they need CUDA graphs and TP 1)", file=sys.stderr)
        return 2
    pw = runner.prefill_graphs()
    runner.capture_cuda_graphs()  # the mixed steps' decode-only steps replay these either way
    reserved = torch.cuda.memory_reserved(runner.device) if device == "cuda" else 0
    seconds = runner.capture_prefill_graphs()
    memory = ""
    if device == "cuda":
        memory = f", {(torch.cuda.memory_reserved(runner.device) - reserved) / (1 << 20):.0f} MiB more reserved"
    name = torch.cuda.get_device_name(runner.device) if device == "cuda" else "cpu"
    print(f"# {model} on {name} ({runner.dtype}); prefill graphs up to {pw.max_tokens} tokens, sizes "
          f"{pw.sizes}, captured in {seconds:.1f}s{memory}"
          + ("" if pw.captured else " (not captured: eager segments)"))

    def measure(graphs: bool, size: int, fn, *a) -> tuple[float, float]:
        """`fn(*a)` with the graphs on or off, a timed step of `size` tokens: its seconds and the
        median seconds `execute` took to return for the steps of that size after the first."""
        runner.prefill_graph_max_tokens = args.max_tokens if graphs else 0
        before = pw.num_runs
        execute_calls.clear()
        value = fn(*a)
        ran = pw.num_runs - before
        if (not graphs and ran) or (graphs and size <= args.max_tokens and not ran):
            raise RuntimeError(f"{fn.__name__}{a}: graphs {'on' if graphs else 'off'} but {ran} graph runs")
        host = [s for n, s in execute_calls if n == size][1:]  # the first is the timers' warm-up
        if not host:
            raise RuntimeError(f"{fn.__name__}{a}: no timed step of {size} tokens ran")
        return value, statistics.median(host)

    turn = itertools.count()
    ratios = []

    def row(label: str, size: int, fn, *a) -> None:
        """One table row: `fn(*a)` with the graphs off and on (the order alternating row by row)."""
        order = (True, False) if next(turn) % 2 == 0 else (False, True)
        got = {mode: measure(mode, size, fn, *a) for mode in order}
        (eager, eager_host), (graphs, graphs_host) = got[False], got[True]
        if size <= args.max_tokens:
            ratios.append(eager / graphs)
        else:
            label += " (over --max-tokens: eager both)"
        print(f"| {label} | {eager * 1e3:.2f} | {graphs * 1e3:.2f} | {eager / graphs:.2f}x "
              f"| {eager_host * 1e3:.2f} | {graphs_host * 1e3:.2f} |")

    try:  # the profiler's grids name what does not fit this engine
        prompts = profiler.prefill_grid(args.prompts) if args.prompts else []
        mixed = profiler.mixed_grid(args.batches, args.chunks, args.context) if args.batches and args.chunks else None
    except ValueError as exc:
        print(f"bench_prefill_graphs: error: {exc}", file=sys.stderr)
        return 2
    if prompts:
        print("| prompt tokens (alone) | eager ms | graphs ms | eager / graphs | host eager ms | host graphs ms |")
        print("|---|---|---|---|---|---|")
    for n in prompts:
        row(str(n), n, profiler.prefill_seconds, n)
    if mixed is not None:  # empty --batches or --chunks: no mixed table
        batches, chunks = mixed
        print("\n| mixed step: decodes + chunk | eager ms | graphs ms | eager / graphs | host eager ms "
              "| host graphs ms |")
        print("|---|---|---|---|---|---|")
        for b in batches:
            for t in chunks:
                row(f"{b} + {t}", b + t, profiler.mixed_step_seconds, b, t, args.context)
    if ratios:
        print(f"\ngeometric mean of eager / graphs where the graphs ran: "
              f"{statistics.geometric_mean(ratios):.2f}x over {len(ratios)} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
