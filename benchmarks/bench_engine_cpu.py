"""Engine vs transformers `generate` on the same SmolLM2 weights (fp32, CPU), in one run.

    python -m benchmarks.bench_engine_cpu [--model smollm2] [--new-tokens 128] [--batch 16] [--compile]
                                          [--no-packed-weights]

Each side runs in its own subprocess so peak resident memory is measured per side. Prints
single-stream decode tokens/s, batch-of-16 output tokens/s, their ratios, and the engine's
peak RSS (its KV budget included). With ``--compile`` the engine runs its decode steps
through torch.compile (`LLM(compile=True)`); the compilation happens in the warm-up and is
reported apart (inductor's on-disk cache makes later runs start faster). The engine's weights
are in MKL's packed GEMM layout (its default on CPU fp32) unless ``--no-packed-weights``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # each side runs as a module from here

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a transformer language model generates text, step by step.",
    "List ten facts about the planet Mars.",
    "What are the main differences between Python and C?",
    "Describe the water cycle to a ten year old.",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "How do vaccines work?",
    "Write a haiku about autumn leaves.",
    "What is the capital of France and why is it famous?",
    "Explain the rules of chess briefly.",
    "What is a prime number? Give examples.",
    "Describe a day in the life of a honeybee.",
    "How does a refrigerator keep food cold?",
    "Tell me about the history of the bicycle.",
]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_engine(args) -> dict:
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams

    llm = LLM(args.model, dtype="float32", device="cpu", kv_cache_gib=args.kv_cache_gib,
              max_num_seqs=max(args.batch, 16), compile=args.compile,
              packed_weights=not args.no_packed_weights)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS[: args.batch]]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=args.new_tokens + 1, temperature=0, ignore_eos=True)
    warm = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    if args.compile:  # the batch-1 and the batch > 1 graphs
        llm.generate(prompts[:3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    warm = time.perf_counter() - warm
    t0 = time.perf_counter()
    llm.generate(prompts[:1], one)
    t1 = time.perf_counter()
    llm.generate(prompts[:1], full)
    t2 = time.perf_counter()
    single = args.new_tokens / ((t2 - t1) - (t1 - t0))
    t3 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True))
    t4 = time.perf_counter()
    produced = sum(len(o.token_ids) for o in outs)
    return {"single_tok_s": single, "batch_tok_s": produced / (t4 - t3), "peak_rss_mib": peak_rss_mib(),
            "kv_cache_mib": llm.engine.runner.kv_cache_bytes / (1 << 20), "warmup_s": warm}


def run_transformers(args) -> dict:
    import torch
    import transformers

    from pdserve.loaders import load_model_source

    src = load_model_source(args.model)
    c = src.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    state = dict(src.iter_weights())
    model.load_state_dict(state, strict=False)
    if c.tie_word_embeddings:
        model.tie_weights()
    tok = src.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS[: args.batch]]

    def gen(batch: list[list[int]], n: int) -> float:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - t

    gen(prompts[:1], 8)  # warm-up
    t_first = gen(prompts[:1], 1)
    t_full = gen(prompts[:1], args.new_tokens + 1)
    t_batch = gen(prompts, args.new_tokens)
    return {"single_tok_s": args.new_tokens / (t_full - t_first),
            "batch_tok_s": len(prompts) * args.new_tokens / t_batch, "peak_rss_mib": peak_rss_mib()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=3, help="alternating runs of each side; medians are reported")
    p.add_argument("--compile", action="store_true", help="engine decode steps through torch.compile")
    p.add_argument("--no-packed-weights", action="store_true", help="engine weights dense, not MKL-packed")
    p.add_argument("--side", choices=["engine", "transformers"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if not 1 <= args.batch <= len(PROMPTS):
        p.error(f"--batch must be in [1, {len(PROMPTS)}]")
    if args.side:
        import torch

        torch.set_num_threads(args.threads)
        result = run_engine(args) if args.side == "engine" else run_transformers(args)
        print(json.dumps(result))
        return 0
    runs: dict[str, list[dict]] = {"engine": [], "transformers": []}
    for _ in range(args.rounds):  # alternate the sides so machine drift hits both alike
        for side in ("engine", "transformers"):
            cmd = ([sys.executable, "-m", "benchmarks.bench_engine_cpu", "--side", side, "--model", args.model,
                    "--new-tokens", str(args.new_tokens), "--batch", str(args.batch),
                    "--kv-cache-gib", str(args.kv_cache_gib), "--threads", str(args.threads)]
                   + (["--compile"] if args.compile else [])
                   + (["--no-packed-weights"] if args.no_packed_weights else []))
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return proc.returncode
            runs[side].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    for side, rs in runs.items():
        print(f"{side}: " + "; ".join(f"single {r['single_tok_s']:.1f}, batch {r['batch_tok_s']:.1f} tok/s"
                                      for r in rs))
    e, t = ({k: statistics.median(r[k] for r in runs[side]) for k in runs[side][0]} for side in runs)
    mode = "eager"
    if args.compile:
        warmups = ", ".join(f"{r['warmup_s']:.0f}" for r in runs["engine"])
        mode = f"torch.compile (warm-up with compilation: {warmups} s)"
    weights = "dense" if args.no_packed_weights else "MKL-packed"
    print(f"model {args.model}, fp32 CPU, {args.threads} threads, {args.new_tokens} new tokens, "
          f"median of {args.rounds} alternating rounds; engine decode {mode}, {weights} weights")
    print(f"{'':24}{'pdserve':>12}{'transformers':>14}{'ratio':>8}")
    print(f"{'single-stream tok/s':24}{e['single_tok_s']:12.1f}{t['single_tok_s']:14.1f}"
          f"{e['single_tok_s'] / t['single_tok_s']:8.2f}x")
    print(f"{f'batch-{args.batch} tok/s':24}{e['batch_tok_s']:12.1f}{t['batch_tok_s']:14.1f}"
          f"{e['batch_tok_s'] / t['batch_tok_s']:8.2f}x")
    print(f"{'peak RSS MiB':24}{e['peak_rss_mib']:12.0f}{t['peak_rss_mib']:14.0f}")
    print(f"engine KV cache: {e['kv_cache_mib']:.0f} MiB (included in its peak RSS)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
