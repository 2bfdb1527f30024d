"""The cost of structured outputs: decode TPOT with and without a JSON-schema constraint.

For each batch size, B chat requests asking for a JSON document decode together, free and then each
under the same JSON schema (an array of records: strings, an enum, integers, booleans), alternately,
`--repeats` times. TPOT is the median wall time of the engine's decode steps while all B requests
run (prefill steps left out), the least over the repeats (on a shared machine, the run least
disturbed by others). "grammar" is the time per decode step spent in the bitmask fill and the
masking kernel alone, timed around them. The constrained run pays the grammar:
the bitmask fill (once the forward is launched), its copy to the device, the masking kernel, the
matchers' advance and the host round trip they need (no overlapped steps). The schema is compiled
before anything is timed (once per distinct schema, cached after).

    python -m benchmarks.bench_grammar                        # CPU: the embedded SmolLM2-135M
    python -m benchmarks.bench_grammar --model random:tiny-serve-tp --tokenizer smollm2   # a tiny body
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
    "properties": {"people": {"type": "array", "minItems": 8, "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "active": {"type": "boolean"},
        },
        "required": ["name", "role", "age", "active"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}
ASK = "List {n} people as JSON: for each a name, a role (engineer, doctor, teacher or artist), an age and whether " \
      "they are active."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model spec (default: the embedded SmolLM2-135M)")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec (the grammar needs one: a random body's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=3, help="free and constrained runs per batch, alternately")
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


class GrammarTimer:
    """Times the bitmask fill and the masking kernel (wrapped where the engine and sampler call them)."""

    def __init__(self, engine) -> None:
        import pdserve.structured.backend as backend

        self.seconds = 0.0
        fill, apply = engine.grammars.fill, backend.apply_bitmask

        def timed(f):
            def run(*a, **kw):
                t = time.perf_counter()
                try:
                    return f(*a, **kw)
                finally:
                    self.seconds += time.perf_counter() - t
            return run

        engine.grammars.fill = timed(fill)
        backend.apply_bitmask = timed(apply)


def decode_tpot(engine, batch: int, args: argparse.Namespace, structured, timer: GrammarTimer | None = None) -> dict:
    """Median decode step time (ms) while all `batch` requests run, and the grammar's ms per such step."""
    from pdserve.sampling_params import SamplingParams

    tok = engine.tokenizer
    params = SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True, structured=structured)
    for i in range(batch):
        text = tok.apply_chat_template([{"role": "user", "content": ASK.format(n=8 + i % 5)}])
        engine.add_request(f"r{i}", tok.encode(text, add_special_tokens=False), params)
    steps: list[float] = []
    grammar: list[float] = []
    while engine.has_unfinished_requests():
        decoding = (len(engine.scheduler.running) == batch and not engine.scheduler.waiting
                    and all(s.num_output_tokens > 0 for s in engine.scheduler.running))
        if args.device == "cuda":
            torch.cuda.synchronize()
        before = timer.seconds if timer is not None else 0.0
        t = time.perf_counter()
        outputs = engine.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        if decoding and not any(o.finished for o in outputs):
            steps.append(time.perf_counter() - t)
            grammar.append((timer.seconds if timer is not None else 0.0) - before)
    steps, grammar = (steps[2:], grammar[2:]) if len(steps) > 2 else (steps, grammar)  # the first ones warm up
    return {"tpot_ms": 1e3 * statistics.median(steps), "grammar_ms": 1e3 * statistics.median(grammar),
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
    timer = GrammarTimer(engine)
    decode_tpot(engine, 1, args, constraint)  # warm-up
    rows = []
    for batch in args.batches:
        free, constrained = [], []
        for _ in range(args.repeats):
            free.append(decode_tpot(engine, batch, args, None))
            constrained.append(decode_tpot(engine, batch, args, constraint, timer))
        f = min(r["tpot_ms"] for r in free)
        c = min(r["tpot_ms"] for r in constrained)
        g = min(r["grammar_ms"] for r in constrained)
        rows.append({"batch": batch, "free_tpot_ms": f, "json_tpot_ms": c, "grammar_ms": g, "overhead": c / f - 1.0,
                     "grammar_share": g / f, "steps": min(r["steps"] for r in free + constrained)})
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"model {args.model}, vocabulary {engine.model_config.vocab_size}, {device}")
    print(f"grammar engine for the vocabulary + first schema: {setup_s:.2f}s; another schema: {compile_s * 1e3:.1f} ms")
    print(f"{'batch':>5} {'free TPOT ms':>13} {'json TPOT ms':>13} {'overhead':>9} {'grammar ms':>11} "
          f"{'of free':>8} {'steps':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['free_tpot_ms']:>13.2f} {r['json_tpot_ms']:>13.2f} {r['overhead']:>8.1%} "
              f"{r['grammar_ms']:>11.2f} {r['grammar_share']:>7.1%} {r['steps']:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": device, "setup_s": setup_s, "compile_s": compile_s,
                       "rows": rows}, f, indent=1)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
