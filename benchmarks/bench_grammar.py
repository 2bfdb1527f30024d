"""The cost of structured outputs: decode TPOT with and without a JSON-schema constraint.

For each batch size, B requests decode together twice: free, then each under the same JSON schema
(an array of records: strings, an enum, integers, booleans, so that the mask changes at every
token). TPOT is the mean wall time of the engine's decode steps while all B requests run (the
prefill steps are left out); the constrained run pays the grammar: the bitmask fill (on a helper
thread while the forward runs), its copy to the device, the masking kernel, the matcher's advance
and the host round trip it needs (no overlapped steps). The schema is compiled before the timed
steps (one compile per distinct schema, cached after).

    python -m benchmarks.bench_grammar                        # CPU: a tiny model on SmolLM2's vocabulary
    python -m benchmarks.bench_grammar --device cuda --model random:llama-3.1-8b --tokenizer smollm2
    python -m benchmarks.bench_grammar --batches 1,16,64 --steps 32 --json out.json

Results and their hardware go in docs/structured.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 8, "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "kind", "score", "ok"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny-serve-tp", help="model spec (default: a tiny random model)")
    p.add_argument("--tokenizer", default="smollm2", help="tokenizer spec (the grammar needs one)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def build_engine(args: argparse.Namespace, max_batch: int):
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import LLMEngine

    cache = CacheConfig(cpu_kv_gib=args.kv_cache_gib) if args.device == "cpu" else CacheConfig()
    return LLMEngine(EngineConfig(model=args.model, tokenizer=args.tokenizer, device=args.device, cache=cache,
                                  scheduler=SchedulerConfig(max_num_seqs=max_batch)))


def decode_tpot(engine, batch: int, args: argparse.Namespace, structured) -> dict:
    """Mean and median decode step time (ms) while all `batch` requests run."""
    from pdserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True, structured=structured)
    for i in range(batch):
        prompt = [(7 * i + 13 * j) % 4000 + 100 for j in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, params)
    steps: list[float] = []
    while engine.has_unfinished_requests():
        decoding = (len(engine.scheduler.running) == batch and not engine.scheduler.waiting
                    and all(s.num_output_tokens > 0 for s in engine.scheduler.running))
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        outputs = engine.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        if decoding and not any(o.finished for o in outputs):
            steps.append(time.perf_counter() - t)
    steps = steps[2:] or steps  # the first decode steps warm caches up
    return {"tpot_ms": 1e3 * statistics.fmean(steps), "tpot_median_ms": 1e3 * statistics.median(steps),
            "steps": len(steps)}


def main(argv: list[str] | None = None) -> int:
    from pdserve.structured.spec import StructuredOutput

    args = parse_args(argv)
    engine = build_engine(args, max(args.batches))
    constraint = StructuredOutput.json_schema(SCHEMA, strict=True)
    t = time.perf_counter()
    engine.grammars.compile(constraint)  # the vocabulary and the schema, before anything is timed
    setup_s = time.perf_counter() - t
    t = time.perf_counter()
    engine.grammars.compile(StructuredOutput.json_schema({**SCHEMA, "title": "another"}))
    compile_s = time.perf_counter() - t
    decode_tpot(engine, 1, args, None)  # warm-up
    rows = []
    for batch in args.batches:
        free = decode_tpot(engine, batch, args, None)
        constrained = decode_tpot(engine, batch, args, constraint)
        rows.append({"batch": batch, "free_tpot_ms": free["tpot_ms"], "json_tpot_ms": constrained["tpot_ms"],
                     "free_median_ms": free["tpot_median_ms"], "json_median_ms": constrained["tpot_median_ms"],
                     "overhead": constrained["tpot_ms"] / free["tpot_ms"] - 1.0,
                     "steps": min(free["steps"], constrained["steps"])})
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"model {args.model}, vocabulary {engine.model_config.vocab_size}, {device}")
    print(f"grammar engine for the vocabulary + first schema: {setup_s:.2f}s; another schema: {compile_s * 1e3:.1f} ms")
    print(f"{'batch':>5} {'free TPOT ms':>13} {'json TPOT ms':>13} {'overhead':>9} {'steps':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['free_tpot_ms']:>13.2f} {r['json_tpot_ms']:>13.2f} {r['overhead']:>8.1%} "
              f"{r['steps']:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": device, "setup_s": setup_s, "compile_s": compile_s,
                       "rows": rows}, f, indent=1)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
