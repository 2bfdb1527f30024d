"""Where a decode step's time goes on a CUDA GPU: kernels, idle gaps and host work.

    python3 -m benchmarks.profile_decode_gpu [--model random:llama-3.1-8b] [--batches 1 64 256]

For each decode batch size (context ~ --input-len), with CUDA graphs and then eagerly:

* the wall time per decode-only step (the engine's `step`, sampling included);
* from `torch.profiler` over a few steps: the GPU's busy time per step (the union of kernel
  intervals), its idle share, and the kernel time per step by kind (matmul, attention,
  norm, RoPE/KV write, activation, sampling, copies) and by kernel name;
* eagerly at batch 1, a `cProfile` of the host: the functions the step spends its time in.

Then whole-prompt prefills (--prefill-lens, one request, nothing else running): the wall time
of the request, the kernels by kind, the gaps, and the matmul kernels' rate against the bf16
matmul rate of a square product (what `bench_engine_gpu.py`'s TTFT bound uses).

Then mixed steps the way a serving worker runs them (a token budget of --mixed-budget): a
decode batch of B with one prompt being prefilled in chunks, against the decode-only step
of the same batch and the chunk alone. Prints a table per part and writes --json.
`--device cpu` runs the same code on a tiny model (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import re
import sys
import time

from benchmarks.bench_engine_gpu import StepTimer, matmul_rate, prefill_flops, prompts

KINDS = (  # first match wins
    ("attention", r"attention|attn|_decode_split|_decode_reduce|flash"),
    ("rope/kv write", r"rope|write_kv|kv_cache"),
    ("norm", r"norm"),
    ("activation", r"silu|gelu|act_and_mul"),
    ("matmul", r"gemm|sm90|sm80|cutlass|nvjet|xmma|cublas|splitk|matmul"),
    ("sampling", r"argmax|softmax|topk|sort|multinomial|exponential|log_softmax|max_kernel|reduce"),
    ("copy/other", r"."),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "copy/other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def kernel_profile(torch, engine, steps: int, body=None) -> dict:
    """Runs `steps` engine steps (or `steps` calls of `body`) under torch.profiler; kernel time
    per step by kind and name."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            (body or engine.step)()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels: list[tuple[str, float, float]] = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) is not None and evt.device_type.name == "CUDA":
            tr = evt.time_range
            kernels.append((evt.name, tr.start, tr.end))
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for name, a, b in kernels:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + (b - a)
        by_name[name] = by_name.get(name, 0.0) + (b - a)
    busy = union_us([(a, b) for _, a, b in kernels])
    ordered = sorted(kernels, key=lambda k: k[1])
    gaps = []
    end, last = None, ""
    for name, a, b in ordered:
        if end is not None and a - end > 20:
            gaps.append((a - end, last[:40], name[:40]))
        if end is None or b > end:
            end, last = b, name
    gaps.sort(reverse=True)
    span = (max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)) if kernels else 0.0
    return {
        "steps": steps, "wall_ms_per_step": wall / steps * 1e3,
        "kernels_per_step": len(kernels) / steps,
        "gpu_busy_ms_per_step": busy / steps / 1e3,
        "gpu_span_ms_per_step": span / steps / 1e3,
        "by_kind_ms_per_step": {k: v / steps / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "gaps_over_20us_ms_per_step": sum(g for g, _, _ in gaps) / steps / 1e3,
        "largest_gaps_us": [[round(g, 1), before, after] for g, before, after in gaps[:6]],
        "top_kernels_ms_per_step": {k[:90]: v / steps / 1e3
                                    for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]},
    }


def host_profile(engine, steps: int) -> list[tuple[str, float, float, int]]:
    """cProfile of `steps` steps: (function, tottime ms/step, cumtime ms/step, calls/step)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (path, line, func), (cc, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(path)}:{line}({func})"
        rows.append((where, tt / steps * 1e3, ct / steps * 1e3, nc // steps))
    rows.sort(key=lambda r: -r[1])
    return rows[:25]


def to_decode(engine, runner, batch: int, input_len: int, vocab: int, total_steps: int, seed: int) -> None:
    """Admits `batch` requests and steps until they all decode (the next step is decode-only)."""
    from pdserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=total_steps, temperature=0, ignore_eos=True)
    for i, tokens in enumerate(prompts(batch, input_len, vocab, seed=seed)):
        engine.add_request(f"prof-{seed}-{i}", tokens, params)
    for _ in range(10_000):
        before = runner.num_decode_only_steps
        engine.step()
        if runner.num_decode_only_steps > before and len(engine.scheduler.running) == batch:
            return
    raise RuntimeError(f"batch {batch} never reached decode-only steps")


def prefill_profile(torch, engine, n: int, vocab: int, rate: float) -> dict:
    """One `n`-token prompt prefilled with nothing else running (max_tokens=1, new prompts
    each time, so the prefix cache never hits): wall time per request, then one request under
    the profiler (`kernel_profile` with the request as its step)."""
    from pdserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    draws = iter(prompts(6, n, vocab, seed=9000 + n))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def one() -> None:
        rid = f"prof-prefill-{n}-{time.perf_counter_ns()}"
        engine.add_request(rid, next(draws), params)
        while rid in engine.requests:
            engine.step()

    one()  # warm: this length's first prefill
    walls = []
    for _ in range(3):
        sync()
        t = time.perf_counter()
        one()
        sync()
        walls.append((time.perf_counter() - t) * 1e3)
    row = {"prompt": n, "wall_ms": sorted(walls)[1], "walls_ms": walls,
           **kernel_profile(torch, engine, 1, body=one)}
    c = engine.model_config
    matmul_flops = 2 * n * c.num_layers * c.hidden_size * (2 * c.q_size + 2 * c.kv_size + 3 * c.intermediate_size)
    row["matmul_ms"] = row["by_kind_ms_per_step"].get("matmul", 0.0)
    row["matmul_tflop_s"] = matmul_flops / (row["matmul_ms"] / 1e3) / 1e12 if row["matmul_ms"] else 0.0
    row["flops_bound_ms"] = prefill_flops(c, n) / rate * 1e3
    return row


def print_kernels(row: dict, per: str) -> None:
    """A `kernel_profile` row's gaps, kernel time by kind and top kernels, `per` step or request."""
    print(f"  gaps over 20 us between kernels: {row['gaps_over_20us_ms_per_step']:.2f} ms/{per}; largest (us, "
          f"after, before): {row['largest_gaps_us'][:4]}")
    for k, v in row["by_kind_ms_per_step"].items():
        print(f"  {k:<14} {v:7.3f} ms")
    for k, v in row["top_kernels_ms_per_step"].items():
        print(f"    {v:7.3f} ms  {k}")


def abort_all(engine) -> None:
    for rid in list(engine.requests):
        engine.abort_request(rid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default random:llama-3.1-8b (cpu: random:tiny-llama)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 64, 256])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12, help="profiled steps per point")
    p.add_argument("--mixed-budget", type=int, default=512, help="token budget of the mixed steps (a serving worker's)")
    p.add_argument("--mixed-batches", type=int, nargs="*", default=[16, 64])
    p.add_argument("--mixed-prompt", type=int, default=2048)
    p.add_argument("--prefill-lens", type=int, nargs="*", default=[2048, 8192],
                   help="whole-prompt prefills to profile (none: skip)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("profile_decode_gpu: needs a CUDA GPU (none found); --device cpu runs a smoke test", file=sys.stderr)
        return 2
    from pdserve.llm import LLM
    from pdserve.warmup import warm_up

    model = args.model or ("random:llama-3.1-8b" if args.device == "cuda" else "random:tiny-llama")
    cuda = args.device == "cuda"
    llm = LLM(model, dtype="bfloat16" if cuda else "float32", device=args.device,
              max_num_seqs=max(args.batches + args.mixed_batches, default=1) + 1,
              max_num_batched_tokens=max([8192] + args.prefill_lens), gpu_memory_fraction=0.85,
              **({} if cuda else {"num_blocks": 2048, "block_size": 16}))
    engine, runner = llm.engine, llm.engine.runner
    vocab = engine.model_config.vocab_size
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{gpu}: {model}; {warm_up(engine).describe()}", flush=True)
    results: dict = {"gpu": gpu, "model": model, "decode": [], "prefill": [], "mixed": []}
    graphs = runner.use_cuda_graphs
    steps = args.steps
    for batch in args.batches:
        for mode in (["graphs", "eager"] if graphs else ["eager"]):
            runner.use_cuda_graphs = mode == "graphs"
            to_decode(engine, runner, batch, args.input_len, vocab, 4 * steps + 8, seed=batch)
            for _ in range(2):
                engine.step()
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = (time.perf_counter() - t) / steps * 1e3
            row = {"batch": batch, "mode": mode, "wall_ms_per_step": wall, **kernel_profile(torch, engine, steps)}
            row["wall_ms_per_step_unprofiled"] = wall
            if (mode == "eager" and batch == min(args.batches)) or (mode == "graphs" and batch == max(args.batches)):
                row["host"] = host_profile(engine, steps)
            abort_all(engine)
            results["decode"].append(row)
            print(f"\ndecode batch {batch} ({mode}): {wall:.2f} ms/step unprofiled, "
                  f"{row['wall_ms_per_step']:.2f} profiled; "
                  f"GPU busy {row['gpu_busy_ms_per_step']:.2f} ms/step ({row['kernels_per_step']:.0f} kernels), "
                  f"idle {max(0.0, 1 - row['gpu_busy_ms_per_step'] / row['wall_ms_per_step']):.0%} of the step",
                  flush=True)
            print_kernels(row, "step")
            for where, tt, ct, n in row.get("host", [])[:20]:
                print(f"  host {tt:7.3f} ms self {ct:7.3f} ms cum {n:5d} calls  {where}")
    runner.use_cuda_graphs = graphs

    # ---- whole-prompt prefills: where a TTFT's time goes ----------------------------------------
    if args.prefill_lens:
        rate = matmul_rate(torch, args.device, 8192 if cuda else 256)
        print(f"\nbf16 matmul rate (square product): {rate / 1e12:.0f} TFLOP/s", flush=True)
        results["matmul_tflop_s"] = rate / 1e12
    for n in args.prefill_lens:
        if n >= engine.max_model_len:
            print(f"\nprefill of {n} tokens: skipped (the model's context is {engine.max_model_len})")
            continue
        row = prefill_profile(torch, engine, n, vocab, rate)
        results["prefill"].append(row)
        print(f"\nprefill of {n} tokens: {row['wall_ms']:.2f} ms a request unprofiled (median of 3); FLOPs bound "
              f"{row['flops_bound_ms']:.2f} ms (fraction {row['flops_bound_ms'] / row['wall_ms']:.3f}); GPU busy "
              f"{row['gpu_busy_ms_per_step']:.2f} ms ({row['kernels_per_step']:.0f} kernels), span "
              f"{row['gpu_span_ms_per_step']:.2f} ms; matmul kernels {row['matmul_ms']:.2f} ms = "
              f"{row['matmul_tflop_s']:.0f} TFLOP/s ({row['matmul_tflop_s'] * 1e12 / rate:.2f} of the square rate)",
              flush=True)
        print_kernels(row, "request")

    # ---- mixed steps: decodes plus a prefill chunk, a serving worker's token budget -----------
    from pdserve.sampling_params import SamplingParams

    import dataclasses

    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_num_batched_tokens=args.mixed_budget)
    for batch in args.mixed_batches:
        to_decode(engine, runner, batch, args.input_len, vocab, 4 * args.input_len // args.mixed_budget * batch + 64,
                  seed=1000 + batch)
        with StepTimer(engine) as timer:
            for _ in range(4):
                engine.step()  # decode-only
            engine.add_request("prof-mixed", prompts(1, args.mixed_prompt, vocab, seed=7000 + batch)[0],
                               SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            while "prof-mixed" in engine.requests and len(timer.records) < 64:
                engine.step()
            for _ in range(3):
                engine.step()
        decode_only = [r[0] for r in timer.records if r[1]]
        mixed = [r[0] for r in timer.records if not r[1]]
        abort_all(engine)
        # the chunk alone: the same prompt with nothing else running
        with StepTimer(engine) as timer:
            engine.add_request("prof-alone", prompts(1, args.mixed_prompt, vocab, seed=8000 + batch)[0],
                               SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            while "prof-alone" in engine.requests and len(timer.records) < 64:
                engine.step()
        alone = [r[0] for r in timer.records]
        abort_all(engine)
        med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3 if xs else float("nan")  # noqa: E731
        row = {"batch": batch, "budget": args.mixed_budget, "prompt": args.mixed_prompt,
               "decode_only_ms": med(decode_only), "mixed_ms": med(mixed), "mixed_steps": len(mixed),
               "chunk_alone_ms": med(alone), "chunk_steps": len(alone)}
        row["mixed_over_sum"] = row["mixed_ms"] / (row["decode_only_ms"] + row["chunk_alone_ms"])
        results["mixed"].append(row)
        print(f"\nmixed steps, budget {args.mixed_budget}, decode batch {batch} + a {args.mixed_prompt}-token prompt: "
              f"mixed {row['mixed_ms']:.2f} ms/step (median of {len(mixed)}), decode-only {row['decode_only_ms']:.2f}, "
              f"chunk alone {row['chunk_alone_ms']:.2f} (median of {len(alone)}): mixed / (decode + chunk) "
              f"{row['mixed_over_sum']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
