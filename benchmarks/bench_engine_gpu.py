"""Engine speed on a CUDA GPU, as ratios to limits measured in the same run.

    python benchmarks/bench_engine_gpu.py [--model random:llama-3.1-8b] [--requests 512]

Prints: device-copy bandwidth; batch-1 decode tokens/s against the weight-read roofline
(weight bytes / copy bandwidth); TTFT for 2k and 8k prompts; offline throughput (N requests,
1024 in / 256 out) against transformers `generate` on the same weights (static batches).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time


def copy_bandwidth(torch, nbytes: int = 1 << 30) -> float:
    import triton.testing

    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=50)
    del x, y
    return 2 * nbytes / (ms / 1e3)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 32000)) for _ in range(length)] for _ in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hf-batch", type=int, default=64, help="transformers static batch size")
    p.add_argument("--hf-requests", type=int, default=128, help="requests given to transformers")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--skip-offline", action="store_true")
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("bench_engine_gpu: needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams

    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth(torch)
    results: dict = {"gpu": gpu, "model": args.model, "copy_gb_s": bw / 1e9}
    print(f"{gpu}: device copy {bw / 1e9:.0f} GB/s")

    t = time.perf_counter()
    llm = LLM(args.model, dtype="bfloat16", device="cuda", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_fraction=0.85)
    print(f"loaded {args.model} in {time.perf_counter() - t:.1f}s; "
          f"KV cache {llm.engine.runner.num_blocks} blocks")
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    if llm.engine.model_config.tie_word_embeddings:
        weight_bytes -= llm.engine.runner.model.lm_head.numel() * 2
    vocab = llm.engine.model_config.vocab_size
    greedy = dict(temperature=0, ignore_eos=True)

    # batch-1 decode against the weight-read roofline, CUDA graphs (default) and eager
    runner = llm.engine.runner
    roofline = bw / weight_bytes
    p1 = prompts(1, 32, vocab)
    t = time.perf_counter()
    llm.generate(p1, SamplingParams(max_tokens=16, **greedy))  # captures the decode graphs
    results["warmup_and_capture_s"] = time.perf_counter() - t
    graphs = runner.use_cuda_graphs
    for mode in (["graphs", "eager"] if graphs else ["eager"]):
        runner.use_cuda_graphs = mode == "graphs"
        llm.generate(p1, SamplingParams(max_tokens=16, **greedy))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(p1, SamplingParams(max_tokens=1, **greedy))
        t1 = time.perf_counter()
        llm.generate(p1, SamplingParams(max_tokens=257, **greedy))
        t2 = time.perf_counter()
        decode_tps = 256 / ((t2 - t1) - (t1 - t0))
        key = "batch1_decode_tok_s" if mode == "graphs" or not graphs else "batch1_decode_eager_tok_s"
        results[key] = decode_tps
        results[key.replace("tok_s", "roofline_fraction")] = decode_tps / roofline
        print(f"batch-1 decode ({mode}): {decode_tps:.1f} tok/s = {1e3 / decode_tps:.2f} ms/token; "
              f"weight-read roofline {roofline:.1f} tok/s ({weight_bytes / 1e9:.2f} GB / copy bw); "
              f"fraction {decode_tps / roofline:.2f}")
    runner.use_cuda_graphs = graphs
    results.update(roofline_tok_s=roofline, weight_gb=weight_bytes / 1e9,
                   roofline_fraction=results["batch1_decode_tok_s"] / roofline)

    # TTFT
    for n in (2048, 8192):
        pr = prompts(1, n, vocab, seed=n)
        llm.generate(pr, SamplingParams(max_tokens=1, **greedy))  # warm
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts(1, n, vocab, seed=n + 1), SamplingParams(max_tokens=1, **greedy))
        ttft = time.perf_counter() - t
        results[f"ttft_{n}_s"] = ttft
        print(f"TTFT {n} tokens: {ttft * 1e3:.0f} ms")

    dump(results, args.json)
    if args.skip_offline:
        return 0
    # offline throughput
    reqs = prompts(args.requests, args.input_len, vocab, seed=1)
    params = SamplingParams(max_tokens=args.output_len, **greedy)
    torch.cuda.synchronize()
    t = time.perf_counter()
    replays = runner.num_graph_replays
    steps = llm.engine.num_steps
    split = {"graph_s": 0.0, "eager_s": 0.0}
    step = llm.engine.step

    def timed_step():  # wall time of decode-only (graph) steps vs steps with prefill work
        before, t_step = runner.num_graph_replays, time.perf_counter()
        out = step()
        split["graph_s" if runner.num_graph_replays > before else "eager_s"] += time.perf_counter() - t_step
        return out

    llm.engine.step = timed_step
    outs = llm.generate(reqs, params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    llm.engine.step = step
    results.update(offline_graph_steps_s=split["graph_s"], offline_eager_steps_s=split["eager_s"])
    ours = sum(len(o.token_ids) for o in outs) / elapsed
    results.update(offline_out_tok_s=ours, offline_seconds=elapsed,
                   offline_steps=llm.engine.num_steps - steps,
                   offline_graph_steps=runner.num_graph_replays - replays)
    print(f"offline: {args.requests} x ({args.input_len} in / {args.output_len} out) in {elapsed:.1f}s = "
          f"{ours:.0f} output tok/s ({results['offline_steps']} steps, "
          f"{results['offline_graph_steps']} replayed from CUDA graphs in {split['graph_s']:.1f}s; "
          f"the others, with prefill work, in {split['eager_s']:.1f}s)")
    dump(results, args.json)

    if not args.skip_hf:
        import transformers

        from pdserve.loaders import load_model_source

        src = load_model_source(args.model)
        del llm, outs, runner, step, timed_step  # the closures hold the engine (and its KV cache)
        gc.collect()
        torch.cuda.empty_cache()
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
        hf_reqs = reqs[: args.hf_requests]
        torch.cuda.synchronize()
        t = time.perf_counter()
        produced = 0
        with torch.inference_mode():
            for i in range(0, len(hf_reqs), args.hf_batch):
                ids = torch.tensor(hf_reqs[i:i + args.hf_batch], device="cuda")
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                                     min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
                produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        hf_elapsed = time.perf_counter() - t
        hf = produced / hf_elapsed
        results.update(hf_out_tok_s=hf, offline_ratio=ours / hf)
        print(f"transformers generate: {len(hf_reqs)} requests in batches of {args.hf_batch}: {hf:.0f} output tok/s;"
              f" pdserve / transformers = {ours / hf:.1f}x")
    dump(results, args.json)
    print("\nsummary (targets: batch-1 decode >= 0.75 of the weight-read roofline; offline >= 10x transformers)")
    for key in ("roofline_fraction", "batch1_decode_eager_roofline_fraction", "ttft_2048_s", "ttft_8192_s",
                "offline_out_tok_s", "hf_out_tok_s", "offline_ratio"):
        if key in results:
            print(f"  {key:<40} {results[key]:.3f}")
    return 0


def dump(results: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
