"""Engine speed on a CUDA GPU, as fractions of limits measured in the same run.

    python3 -m benchmarks.bench_engine_gpu [--quick] [--model random:llama-3.1-8b] [--kv-cache-dtype auto]

Measures first, in this process: the device-copy bandwidth (a 1 GiB copy) and the bf16
matmul rate (8192^3). Then prints, each against its roofline:

* batch-1 decode tokens/s (CUDA graphs, then eager) vs weight bytes / copy bandwidth;
* decode-only steps at batch 64 and 256 (context ~ --input-len) vs (weights + live KV bytes)
  / copy bandwidth, the live KV summed over the running requests at every measured step;
* TTFT for 2k and 8k prompts;
* the offline run (N requests, --input-len in / --output-len out) vs its roofline: the prefill
  FLOPs at the measured matmul rate plus, for the fewest decode steps the batch cap allows
  (ceil(N / max-num-seqs) waves of output-len - 1 steps), the weights once per step and every
  decoding request's context once per token, at the copy bandwidth;
* transformers `generate` on the same weights (static batches), as context only;
* start-up: model load, then the worker's warm-up (pdserve/warmup.py: CUDA graphs, kernel
  compilation for the serving shapes), each timed, and the first request after it.

"Weights" are the bytes a decode step reads: every layer, the final norm and the LM head; not
the embedding table (a step gathers a few of its rows). `--quick` (~3 minutes on an H200)
runs fewer requests, fewer decode steps and a smaller transformers run. `--device cpu` runs
the same code on a tiny model (a smoke test of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

MATMUL_N = 8192


def timed_ms(torch, fn, device: str) -> float:
    """Median milliseconds of `fn` (triton's do_bench on CUDA, a timed loop elsewhere)."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50)
    fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def copy_bandwidth(torch, device: str, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = timed_ms(torch, lambda: y.copy_(x), device)
    x = y = None  # freed (not del: the lambdas above close over them)
    return 2 * nbytes / (ms / 1e3)


def matmul_rate(torch, device: str, n: int = MATMUL_N) -> float:
    """FLOP/s of an n x n x n matmul in bf16 (fp32 off CUDA)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    ms = timed_ms(torch, lambda: a @ b, device)
    a = b = None  # freed (not del: the lambdas above close over them)
    return 2 * n ** 3 / (ms / 1e3)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 32000)) for _ in range(length)] for _ in range(n)]


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table (tied: the
    table is the LM head and is read once)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not model.embed_tokens:
        total -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    return total


def prefill_flops(config, prompt_len: int) -> float:
    """FLOPs of prefilling one prompt: 2 per weight per token for the layers, causal attention
    (QK^T and PV over the visible keys), and the LM head for the last token."""
    c = config
    per_token = 2 * c.num_layers * c.hidden_size * (c.q_size + 2 * c.kv_size + c.q_size
                                                    + 3 * c.intermediate_size)
    visible = prompt_len * (prompt_len + 1) / 2
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * visible
    return per_token * prompt_len + attention + 2 * c.hidden_size * c.vocab_size


class StepTimer:
    """Wraps `engine.step`: wall time of every step, whether it replayed a CUDA graph (or was
    decode-only), how many requests it decoded and the KV tokens they read."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.records: list[tuple[float, bool, int, int]] = []  # (seconds, decode_only, n, kv tokens)
        self._step = engine.step

    def __enter__(self) -> "StepTimer":
        engine, runner = self.engine, self.engine.runner

        def step():
            running = engine.scheduler.running
            before, steps = runner.num_decode_only_steps, engine.num_steps
            kv = sum(s.num_tokens for s in running)
            t = time.perf_counter()
            out = self._step()
            seconds = time.perf_counter() - t
            # a call that launched nothing only waited for the decode-only step launched ahead by
            # the call before it (overlapped decode steps): it is that step's tail, not prefill work
            decode_only = runner.num_decode_only_steps > before or engine.num_steps == steps
            self.records.append((seconds, decode_only, len(out), kv))
            return out

        engine.step = step
        return self

    def __exit__(self, *exc) -> None:
        self.engine.step = self._step

    def decode_only(self, batch: int | None = None) -> list[tuple[float, bool, int, int]]:
        return [r for r in self.records if r[1] and (batch is None or r[2] == batch)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default random:llama-3.1-8b (cpu: random:tiny-llama)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"])
    p.add_argument("--quick", action="store_true", help="a shorter run (~3 minutes on an H200)")
    p.add_argument("--requests", type=int, default=None, help="offline requests (default 512; quick 256)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--decode-batches", type=int, nargs="*", default=[64, 256])
    p.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 64; quick 24)")
    p.add_argument("--hf-batch", type=int, default=64, help="transformers static batch size")
    p.add_argument("--hf-requests", type=int, default=None, help="requests given to transformers (128; quick 64)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--ttft-lens", type=int, nargs="*", default=[2048, 8192])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    quick = args.quick
    requests = args.requests or (256 if quick else 512)
    decode_steps = args.decode_steps or (24 if quick else 64)
    hf_requests = args.hf_requests or (64 if quick else 128)

    import torch

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_engine_gpu: needs a CUDA GPU (none found); --device cpu runs a smoke test", file=sys.stderr)
        return 2
    model_name = args.model or ("random:llama-3.1-8b" if device == "cuda" else "random:tiny-llama")
    from pdserve.engine_args import resolve_switches
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams
    from pdserve.warmup import warm_up

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    t_start = time.perf_counter()
    bw = copy_bandwidth(torch, device, 1 << 30 if device == "cuda" else 1 << 24)
    flops = matmul_rate(torch, device, MATMUL_N if device == "cuda" else 256)
    results: dict = {"gpu": gpu, "model": model_name, "kv_cache_dtype": args.kv_cache_dtype, "quick": quick,
                     "copy_gb_s": bw / 1e9, "matmul_tflop_s": flops / 1e12}
    print(f"{gpu}: device copy {bw / 1e9:.0f} GB/s; bf16 matmul {MATMUL_N}^3 {flops / 1e12:.0f} TFLOP/s"
          + ("" if device == "cuda" else " (cpu: fp32, 256^3)"))

    hf = None
    if not args.skip_hf and device == "cuda":
        # first, in a fresh process that exits before the engine loads: the engine's pools take
        # most of the memory and stay referenced (CUDA graphs, views) until this process ends
        vocab0 = _vocab_size(model_name)
        hf = _in_subprocess(transformers_rate_child, model_name, prompts(hf_requests, args.input_len, vocab0, seed=1),
                            args.hf_batch, args.output_len)

    t = time.perf_counter()
    # the engine switches from the environment, as the CLI reads them (PDSERVE_OVERLAP_STEPS=0,
    # PDSERVE_CUDA_GRAPHS=0, PDSERVE_PREFILL_GRAPHS=1); fp8 KV on CUDA is behind a switch until its GPU tests pass, and
    # measuring it is what --kv-cache-dtype fp8 asks for
    switches = resolve_switches({})
    llm = LLM(model_name, dtype="bfloat16" if device == "cuda" else "float32", device=device,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_fraction=0.85, kv_cache_dtype=args.kv_cache_dtype,
              overlap_steps=switches["overlap_steps"], enforce_eager=not switches["cuda_graphs"],
              prefill_graphs=switches["prefill_graphs"], experimental_fp8_kv=True,
              **({} if device == "cuda" else {"num_blocks": 4096, "block_size": 16}))
    engine, runner = llm.engine, llm.engine.runner
    results["load_s"] = time.perf_counter() - t
    print(f"loaded {model_name} in {time.perf_counter() - t:.1f}s; KV cache {runner.num_blocks} blocks "
          f"({runner.kv_cache_dtype_name}, {runner.kv_cache_bytes / 2**30:.1f} GiB)")
    config = engine.model_config
    weight_bytes = step_weight_bytes(runner.model)
    kv_per_token = runner.kv_bytes_per_token
    vocab = config.vocab_size
    greedy = dict(temperature=0, ignore_eos=True)
    results.update(weight_gb=weight_bytes / 1e9, kv_bytes_per_token=kv_per_token)

    # ---- the worker's warm-up: graphs captured, kernels compiled (pdserve/warmup.py) ----------
    report = warm_up(engine)
    results.update(warmup_s=report.total_s, **{f"warmup_{k}_s": v for k, v in report.seconds.items()})
    print(report.describe())

    # ---- batch-1 decode against the weight-read roofline -------------------------------------
    roofline = bw / weight_bytes
    p1 = prompts(1, 32, vocab)
    t = time.perf_counter()
    llm.generate(p1, SamplingParams(max_tokens=16, **greedy))
    results["first_request_after_warmup_s"] = time.perf_counter() - t
    graphs = runner.use_cuda_graphs
    n1 = 64 if quick else 256
    for mode in (["graphs", "eager"] if graphs else ["eager"]):
        runner.use_cuda_graphs = mode == "graphs"
        llm.generate(p1, SamplingParams(max_tokens=16, **greedy))
        sync()
        t0 = time.perf_counter()
        llm.generate(p1, SamplingParams(max_tokens=1, **greedy))
        t1 = time.perf_counter()
        llm.generate(p1, SamplingParams(max_tokens=n1 + 1, **greedy))
        t2 = time.perf_counter()
        decode_tps = n1 / ((t2 - t1) - (t1 - t0))
        key = "batch1_decode_tok_s" if mode == "graphs" or not graphs else "batch1_decode_eager_tok_s"
        results[key] = decode_tps
        results[key.replace("tok_s", "roofline_fraction")] = decode_tps / roofline
        print(f"batch-1 decode ({mode}): {decode_tps:.1f} tok/s = {1e3 / decode_tps:.2f} ms/token; "
              f"weight-read roofline {roofline:.1f} tok/s ({weight_bytes / 1e9:.2f} GB / copy bw); "
              f"fraction {decode_tps / roofline:.3f}")
    runner.use_cuda_graphs = graphs
    results.update(roofline_tok_s=roofline, roofline_fraction=results["batch1_decode_tok_s"] / roofline)

    # ---- decode-only steps at batch 64 and 256 ---------------------------------------------
    for batch in args.decode_batches:
        if batch > args.max_num_seqs:
            print(f"decode batch {batch}: skipped (over --max-num-seqs {args.max_num_seqs})")
            continue
        # Requests admitted first decode while later ones prefill; the extra tokens keep all
        # `batch` of them running through `decode_steps` decode-only steps after that.
        prefill_steps = math.ceil(batch * args.input_len / args.max_num_batched_tokens) + 2
        reqs = prompts(batch, args.input_len, vocab, seed=batch)
        with StepTimer(engine) as timer:
            llm.generate(reqs, SamplingParams(max_tokens=prefill_steps + decode_steps, **greedy))
        steps = timer.decode_only(batch)[1:]  # the first may include a graph capture or compile
        if not steps:
            print(f"decode batch {batch}: no decode-only step at that batch size")
            continue
        measured = sum(r[0] for r in steps)
        # Both bounds sum the same per-step terms (weights / bw + KV / bw), so the one with the
        # FLOPs is >= this one exactly: rounded addition is monotone.
        bound = sum(weight_bytes / bw + r[3] * kv_per_token / bw for r in steps)
        # With the matmul FLOPs too: a step's projections take at least the longer of their
        # weight read and their FLOPs at the matmul rate (compute-bound from batch ~150 on an
        # H200), then the attention reads the live KV.
        flops_per_row = 2 * weight_bytes / runner.model.norm.element_size()
        bound_c = sum(max(weight_bytes / bw, batch * flops_per_row / flops) + r[3] * kv_per_token / bw
                      for r in steps)
        ctx = sum(r[3] for r in steps) / len(steps) / batch
        frac = bound / measured
        results[f"decode_b{batch}_step_ms"] = measured / len(steps) * 1e3
        results[f"decode_b{batch}_roofline_ms"] = bound / len(steps) * 1e3
        results[f"decode_b{batch}_roofline_fraction"] = frac
        results[f"decode_b{batch}_context"] = ctx
        results[f"decode_b{batch}_bound_ms"] = bound_c / len(steps) * 1e3
        results[f"decode_b{batch}_bound_fraction"] = bound_c / measured
        print(f"decode-only steps at batch {batch} (mean context {ctx:.0f}, {len(steps)} steps): "
              f"{measured / len(steps) * 1e3:.2f} ms/step = {batch * len(steps) / measured:.0f} tok/s; "
              f"memory roofline {bound / len(steps) * 1e3:.2f} ms (weights {weight_bytes / 1e9:.1f} GB + KV "
              f"{ctx * batch * kv_per_token / 1e9:.1f} GB at copy bw); fraction {frac:.3f}; with the matmul FLOPs "
              f"at the matmul rate {bound_c / len(steps) * 1e3:.2f} ms, fraction {bound_c / measured:.3f}")

    # ---- TTFT ------------------------------------------------------------------------------
    for n in args.ttft_lens:
        if n >= engine.max_model_len:
            continue
        llm.generate(prompts(1, n, vocab, seed=n), SamplingParams(max_tokens=1, **greedy))  # warm
        sync()
        t = time.perf_counter()
        llm.generate(prompts(1, n, vocab, seed=n + 1), SamplingParams(max_tokens=1, **greedy))
        ttft = time.perf_counter() - t
        bound = prefill_flops(config, n) / flops
        results[f"ttft_{n}_s"] = ttft
        print(f"TTFT {n} tokens: {ttft * 1e3:.1f} ms; prefill FLOPs at the matmul rate {bound * 1e3:.1f} ms; "
              f"fraction {bound / ttft:.3f}")
    dump(results, args.json)

    # ---- offline throughput and its roofline -------------------------------------------------
    if not args.skip_offline:
        reqs = prompts(requests, args.input_len, vocab, seed=1)
        params = SamplingParams(max_tokens=args.output_len, **greedy)
        pre = requests * prefill_flops(config, args.input_len) / flops
        waves = math.ceil(requests / args.max_num_seqs)
        decode_tokens = requests * (args.output_len - 1)
        kv_tokens = requests * sum(args.input_len + j for j in range(1, args.output_len))
        dec = (waves * (args.output_len - 1) * weight_bytes + kv_tokens * kv_per_token) / bw
        sync()
        with StepTimer(engine) as timer:
            t = time.perf_counter()
            outs = llm.generate(reqs, params, use_tqdm=True)
            elapsed = time.perf_counter() - t
        ours = sum(len(o.token_ids) for o in outs) / elapsed
        dsteps = timer.decode_only()
        d_s = sum(r[0] for r in dsteps)
        o_s = sum(r[0] for r in timer.records) - d_s
        results.update(offline_out_tok_s=ours, offline_seconds=elapsed, offline_steps=len(timer.records),
                       offline_decode_only_steps=len(dsteps), offline_decode_only_s=d_s, offline_other_s=o_s,
                       offline_roofline_s=pre + dec, offline_roofline_prefill_s=pre,
                       offline_roofline_decode_s=dec, offline_roofline_fraction=(pre + dec) / elapsed)
        print(f"offline: {requests} x ({args.input_len} in / {args.output_len} out) in {elapsed:.1f}s = "
              f"{ours:.0f} output tok/s ({len(timer.records)} steps: {len(dsteps)} decode-only in {d_s:.1f}s, "
              f"{len(timer.records) - len(dsteps)} with prefill work in {o_s:.1f}s)")
        print(f"offline roofline: {pre + dec:.1f}s = prefill {pre:.1f}s "
              f"({requests * prefill_flops(config, args.input_len) / 1e15:.2f}"
              f" PFLOP at {flops / 1e12:.0f} TFLOP/s) + decode {dec:.1f}s ({waves} x {args.output_len - 1} steps of "
              f"{weight_bytes / 1e9:.1f} GB weights + {kv_tokens * kv_per_token / 1e12:.1f} TB of KV for "
              f"{decode_tokens} tokens, at copy bw); fraction {(pre + dec) / elapsed:.3f}")
        dump(results, args.json)
        del outs

    if hf is not None:
        results["hf_out_tok_s"] = hf
        if "offline_out_tok_s" in results:
            results["offline_ratio"] = results["offline_out_tok_s"] / hf
        print(f"transformers generate (context, not a target; run first, in its own process): {hf_requests} "
              f"requests in batches of {args.hf_batch}: {hf:.0f} output tok/s")
    results["total_s"] = time.perf_counter() - t_start
    dump(results, args.json)
    print(f"\nsummary ({gpu}, {model_name}, KV {args.kv_cache_dtype}; targets: offline >= 0.8 of its roofline, "
          "decode-only batch 256 >= 0.8, batch-1 decode >= 0.75)")
    for key in ("copy_gb_s", "matmul_tflop_s", "roofline_fraction", "batch1_decode_eager_roofline_fraction",
                "decode_b64_step_ms", "decode_b64_roofline_fraction", "decode_b64_bound_fraction",
                "decode_b256_step_ms", "decode_b256_roofline_fraction", "decode_b256_bound_fraction",
                "ttft_2048_s", "ttft_8192_s", "offline_out_tok_s",
                "offline_roofline_s", "offline_seconds", "offline_roofline_fraction", "hf_out_tok_s",
                "load_s", "warmup_s", "first_request_after_warmup_s", "total_s"):
        if key in results:
            print(f"  {key:<40} {results[key]:.3f}")
    return 0


def _vocab_size(model_name: str) -> int:
    from pdserve.loaders import load_model_source

    return load_model_source(model_name).config.vocab_size


def transformers_rate_child(model_name: str, reqs: list[list[int]], batch: int, output_len: int) -> float:
    import torch

    return transformers_rate(torch, model_name, reqs, batch, output_len)


def _in_subprocess(fn, *args):
    """fn(*args) in a spawned process (a fresh CUDA context); its result."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def transformers_rate(torch, model_name: str, reqs: list[list[int]], batch: int, output_len: int) -> float:
    """Output tokens/s of transformers `generate` on the same weights, static batches."""
    import transformers

    from pdserve.loaders import load_model_source

    src = load_model_source(model_name)
    weights = dict(src.iter_weights("cuda"))
    c = src.config
    rope = None
    if c.rope_scaling is not None:
        rope = {"rope_type": "llama3", "factor": c.rope_scaling.factor,
                "low_freq_factor": c.rope_scaling.low_freq_factor,
                "high_freq_factor": c.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": c.rope_scaling.original_max_position_embeddings}
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_scaling=rope, tie_word_embeddings=c.tie_word_embeddings)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.load_state_dict(weights, strict=False)
    del weights
    torch.cuda.synchronize()
    t = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            ids = torch.tensor(reqs[i:i + batch], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return produced / (time.perf_counter() - t)


def dump(results: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
