"""The serving workload run on the bare engine, in this process: what serving adds on top.

    python3 -m benchmarks.bench_engine_replay [--requests 200] [--rate 8] [--input-len 2048] [--output-len 256]

Poisson arrivals at --rate (seeded), --input-len random prompt tokens, --output-len tokens each
(ignore_eos), fed to an `LLMEngine` with a `pdserve up` worker's settings (--max-num-seqs,
--max-num-batched-tokens, warm-up first) by a loop that admits each request at its arrival time
and steps the engine. Prints TTFT and TPOT p50/p90 and the achieved rate, measured at the engine
(token timestamps taken after each step), and the engine's step count and step-time split
(decode-only vs steps with prefill work).

Run `python -m experiments.bench_warm_start --replicas 1` with the same --requests/--rate/--input-len/
--output-len in the same session for the served figures (router, gRPC worker, HTTP client): the
difference is the serving path (HTTP, tokenising, router, RPC, streaming, the engine thread
sharing the worker process with the gRPC server). `--device cpu` with a tiny model is a smoke
test of this script.

Several workloads on one engine, one after the other, with loadgen records for the simulator:

    python3 -m benchmarks.bench_engine_replay --point 2048:256@1.5 --point 512:1024@3 --requests 64 \
        --max-num-batched-tokens 512 --max-num-seqs 64 --records DIR

writes DIR/summary.csv and DIR/runs/*.jsonl as `pdserve-loadgen experiment` does (one record per
request: its arrival as `sent_s`, first token and last token times at the engine), so that
experiments/sim_fidelity_one_gpu.py --bare DIR sets the simulator against the bare engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from benchmarks.bench_engine_gpu import StepTimer, prompts


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def replay(engine, reqs: list[list[int]], arrivals: list[float], output_len: int, max_s: float,
           records: list | None = None) -> dict:
    """Admits each request at its arrival, steps the engine; TTFT/TPOT at the engine. `records`:
    appends a loadgen RequestRecord per request (times relative to its arrival)."""
    from pdserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    n = len(reqs)
    sent = [0.0] * n
    first = [None] * n
    last = [0.0] * n
    count = [0] * n
    ids = {f"replay-{i}": i for i in range(n)}
    t0 = time.perf_counter()
    i = 0
    while i < n or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        if now > max_s:
            break
        while i < n and arrivals[i] <= now:
            engine.add_request(f"replay-{i}", reqs[i], params)
            sent[i] = now
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(arrivals[i] - now, 0.002)) if i < n else 0.0)
            continue
        outs = engine.step()
        t = time.perf_counter() - t0
        for out in outs:
            j = ids[out.request_id]
            if out.new_token_ids:
                if first[j] is None:
                    first[j] = t
                last[j] = t
                count[j] += len(out.new_token_ids)
    duration = time.perf_counter() - t0
    done = [j for j in range(n) if count[j] >= output_len]
    ttft = [first[j] - sent[j] for j in done]
    tpot = [(last[j] - first[j]) / (count[j] - 1) for j in done if count[j] > 1]
    for rid in list(engine.requests):
        engine.abort_request(rid)
    if records is not None:
        from pdserve.loadgen.records import RequestRecord

        for j in range(n):
            ok = count[j] >= output_len
            records.append(RequestRecord(
                index=j, request_id=f"replay-{j}", scheduled_s=arrivals[j], sent_s=sent[j],
                ttft_s=first[j] - sent[j] if first[j] is not None else None,
                e2e_s=last[j] - sent[j] if ok else None, token_times_s=[], prompt_tokens=len(reqs[j]),
                completion_tokens=count[j] if ok else None, token_count_source="usage" if ok else None,
                prompt_tokens_est=len(reqs[j]), max_tokens=output_len, status=200 if ok else None,
                error=None if ok else "did not finish within --max-run-time"))
    return {"requests": n, "completed": len(done), "duration_s": duration,
            "achieved_rate": len(done) / max(max(last) if done else duration, 1e-9),
            "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p90_ms": percentile(ttft, 90) * 1e3,
            "tpot_p50_ms": percentile(tpot, 50) * 1e3, "tpot_p90_ms": percentile(tpot, 90) * 1e3}


def parse_point(text: str) -> tuple[int, int, float]:
    """"IN:OUT@RATE" -> (prompt tokens, output tokens, req/s); ValueError naming --point."""
    try:
        lengths, rate = text.split("@")
        input_len, output_len = (int(x) for x in lengths.split(":"))
        value = float(rate)
    except ValueError:
        raise ValueError(f"--point: expected IN:OUT@RATE (e.g. 2048:256@1.5), got {text!r}") from None
    if input_len < 1 or output_len < 1 or not value > 0:
        raise ValueError(f"--point {text!r}: lengths must be >= 1 and the rate > 0")
    return input_len, output_len, value


def write_run(out_dir: str, input_len: int, output_len: int, rate: float, run: int, started: float,
              records: list) -> dict:
    """One point's records as loadgen writes them; the summary.csv row that names them."""
    from pdserve.loadgen.records import write_jsonl

    dataset = f"in{input_len}-out{output_len}"
    name = f"bare_{dataset}_rate{rate:g}" + (f"_run{run + 1}" if run else "") + ".jsonl"
    os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)
    write_jsonl(os.path.join(out_dir, "runs", name), records)
    return {"dataset": dataset, "rate": rate, "records_file": f"runs/{name}", "start_time_unix": started,
            "num_requests": len(records), "num_ok": sum(r.error is None for r in records)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default random:llama-3.1-8b (cpu: random:tiny-llama)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's for the device")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's for the device")
    p.add_argument("--runs", type=int, default=2, help="back-to-back runs of the same workload (new prompts each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-run-time", type=float, default=300.0)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--point", action="append", default=[], metavar="IN:OUT@RATE",
                   help="a workload (prompt tokens, output tokens, Poisson rate); repeat for several, run in "
                        "order on one engine, --runs times each (default: --input-len:--output-len@--rate)")
    p.add_argument("--records", metavar="DIR", help="write loadgen records and a summary.csv here (module docstring)")
    args = p.parse_args(argv)
    try:
        points = [parse_point(text) for text in args.point] or [(args.input_len, args.output_len, args.rate)]
    except ValueError as exc:
        p.error(str(exc))

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_engine_replay: needs a CUDA GPU (none found); --device cpu runs a smoke test", file=sys.stderr)
        return 2
    from pdserve.engine_args import resolve_switches
    from pdserve.llm import LLM
    from pdserve.warmup import warm_up

    cuda = args.device == "cuda"
    model = args.model or ("random:llama-3.1-8b" if cuda else "random:tiny-llama")
    # the engine switches from the environment, as `pdserve up` reads them for its workers
    # (PDSERVE_OVERLAP_STEPS, PDSERVE_CUDA_GRAPHS, PDSERVE_PREFILL_GRAPHS): the bare engine and the
    # served one then run the same steps
    switches = resolve_switches({})
    llm = LLM(model, dtype="bfloat16" if cuda else "float32", device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_fraction=0.85,
              overlap_steps=switches["overlap_steps"], enforce_eager=not switches["cuda_graphs"],
              prefill_graphs=switches["prefill_graphs"],
              **({} if cuda else {"num_blocks": 4096, "block_size": 16}))
    engine = llm.engine
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{gpu}: {model}; {warm_up(engine).describe()}", flush=True)
    vocab = engine.model_config.vocab_size
    results = {"gpu": gpu, "model": model, "args": vars(args), "runs": []}
    rows = []
    for k, (input_len, output_len, rate) in enumerate(points):
        for run in range(args.runs):
            rng = random.Random(args.seed + run)
            arrivals, t = [], 0.0
            for _ in range(args.requests):
                t += rng.expovariate(rate)
                arrivals.append(t)
            # every point draws its own prompts: prefix caching (on, as on a worker) would serve a
            # point's prompts from an earlier one's KV
            reqs = prompts(args.requests, input_len, vocab, seed=args.seed + 100 + run + 1000 * k)
            records: list | None = [] if args.records else None
            started = time.time()
            with StepTimer(engine) as timer:
                r = replay(engine, reqs, arrivals, output_len, args.max_run_time, records)
            decode = [s for s in timer.records if s[1]]
            other = [s for s in timer.records if not s[1]]
            r.update(input_len=input_len, output_len=output_len, rate=rate, steps=len(timer.records),
                     decode_only_steps=len(decode),
                     decode_only_ms=sum(s[0] for s in decode) / max(len(decode), 1) * 1e3,
                     prefill_steps=len(other), prefill_step_ms=sum(s[0] for s in other) / max(len(other), 1) * 1e3,
                     mean_decode_batch=sum(s[2] for s in decode) / max(len(decode), 1))
            results["runs"].append(r)
            label = f"{input_len}:{output_len}@{rate:g}" + (f" run {run + 1}" if args.runs > 1 else "")
            print(f"{label}: TTFT p50 {r['ttft_p50_ms']:.0f} ms (p90 {r['ttft_p90_ms']:.0f}), TPOT p50 "
                  f"{r['tpot_p50_ms']:.1f} ms (p90 {r['tpot_p90_ms']:.1f}), {r['achieved_rate']:.2f} req/s achieved, "
                  f"{r['completed']}/{r['requests']} completed; {r['steps']} steps: {r['decode_only_steps']} "
                  f"decode-only ({r['decode_only_ms']:.1f} ms each, mean batch {r['mean_decode_batch']:.1f}), "
                  f"{r['prefill_steps']} with prefill work ({r['prefill_step_ms']:.1f} ms each)", flush=True)
            if records is not None:
                rows.append(write_run(args.records, input_len, output_len, rate, run, started, records))
    if args.records:
        from pdserve.loadgen.runner import write_summary_csv

        write_summary_csv(os.path.join(args.records, "summary.csv"), rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
