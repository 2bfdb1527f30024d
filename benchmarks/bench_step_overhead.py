"""Host (CPU) time of one engine step with the model forward taken out: what the GPU waits
for between decode steps when the forward itself is fast.

    python3 -m benchmarks.bench_step_overhead [--batch 256] [--context 1024] [--steps 40] [--rounds 5]

Builds an engine on a tiny random model, replaces the forward with one that returns zero
logits at once (no device work), puts `--batch` requests of `--context` prompt tokens in the
decode batch, and times `engine.step()` for `--steps` decode-only steps through the decode
path of CUDA graphs (static input buffers; off CUDA the "replay" calls the stub). Prints the
median over rounds of the mean milliseconds per step, split into schedule / runner (inputs) /
sample / postprocess.
Runs on the CPU; the figure is Python time, which on a GPU is GPU idle time unless it overlaps.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--detokenize", action="store_true",
                   help="give the engine SmolLM2's tokenizer, so every token is detokenized (as for "
                        "random:llama-3.1-8b in bench_engine_gpu.py, which carries that tokenizer)")
    args = p.parse_args(argv)

    import torch

    import dataclasses

    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.loaders import load_model_source
    from pdserve.sampling_params import SamplingParams

    blocks = args.batch * (-(-(args.context + args.steps * args.rounds + 32) // 16)) + 16
    source = load_model_source("random:tiny-llama")  # 2 layers: small pools; the forward is a stub
    source = dataclasses.replace(source, config=dataclasses.replace(source.config, max_position_embeddings=1 << 16))
    if args.detokenize:
        source = dataclasses.replace(source, tokenizer=load_model_source("random:smollm2-135m").tokenizer)
    engine = LLMEngine(EngineConfig(model="random:tiny-llama", device="cpu", cache=CacheConfig(num_blocks=blocks),
                                    scheduler=SchedulerConfig(max_num_seqs=args.batch,
                                                              max_num_batched_tokens=args.batch * args.context)),
                       source)
    runner = engine.runner
    vocab = engine.model_config.vocab_size
    runner.use_cuda_graphs = True  # static buffers; off CUDA the replay runs the (stub) forward

    torch.set_num_threads(1)  # tiny ops: thread hand-offs would dominate on a busy host
    zeros = torch.zeros(args.batch, vocab)

    def stub_forward(input_ids, meta, kv_caches, layer_hook=None):
        n = meta.logits_indices.shape[0]
        return zeros[:n] if n <= args.batch else torch.zeros(n, vocab)

    runner.model.forward = stub_forward
    params = SamplingParams(max_tokens=args.steps * args.rounds + 16, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [(i * 7 + j) % (vocab - 10) + 10 for j in range(args.context)], params)
    engine.step()  # the prefill of everyone (stub), then decode-only steps
    parts = {"schedule": 0.0, "execute": 0.0, "sample": 0.0, "postprocess": 0.0}
    wrapped = []
    for obj, name, part in ((engine.scheduler, "schedule", "schedule"), (runner, "execute", "execute"),
                            (runner, "sample", "sample"), (engine.scheduler, "postprocess", "postprocess")):
        fn = getattr(obj, name)

        def timed(*a, _fn=fn, _part=part, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                parts[_part] += time.perf_counter() - t

        setattr(obj, name, timed)
        wrapped.append((obj, name))
    for _ in range(3):
        engine.step()
    rounds = []
    for _ in range(args.rounds):
        for key in parts:
            parts[key] = 0.0
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        total = (time.perf_counter() - t) / args.steps * 1e3
        rounds.append((total, {k: v / args.steps * 1e3 for k, v in parts.items()}))
    assert len(engine.scheduler.running) == args.batch, "every request must still be decoding"
    rounds.sort(key=lambda r: r[0])
    total, detail = rounds[len(rounds) // 2]
    text = ", ".join(f"{k} {v:.2f}" for k, v in detail.items())
    print(f"host time per decode step at batch {args.batch}, context ~{args.context}: median {total:.2f} ms "
          f"of {args.rounds} rounds of {args.steps} steps (min {rounds[0][0]:.2f}); median round: {text}, "
          f"other {total - sum(detail.values()):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
