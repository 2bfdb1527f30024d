"""TTFT and TPOT of disaggregated (1 prefill + 1 decode process) versus colocated (1 mixed
process), with the KV link paced at several rates, in one run.

    python -m benchmarks.bench_pd_ttft [--model random:llama-3.2-1b] [--device cuda]
        [--gbps 1 10 25 100] [--prompt-len 2048] [--requests 8] [--max-tokens 32]

Workers are real `WorkerServer` processes (gRPC request plane, UCX KV plane); on one GPU the
KV goes GPU to GPU between the two processes. The prefill worker's sender is paced by a
token bucket at each rate (the method for transports that bypass the kernel); the achieved
KV rate is printed next to the set rate. Requests run one at a time (no queueing), so TTFT
is prefill + what the transfer adds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import sys
import time


def _serve(role: str, model: str, device: str, pacer: str | None, fraction: float, conn) -> None:
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.worker.server import WorkerConfig, WorkerServer

    engine = EngineConfig(model=model, device=device, cache=CacheConfig(gpu_memory_fraction=fraction,
                                                                        cpu_kv_gib=0.25),
                          scheduler=SchedulerConfig(max_num_batched_tokens=8192))
    opts = (("pacer", pacer),) if pacer else ()
    server = WorkerServer(WorkerConfig(f"{role}-bench", role, engine, kv_backend="ucx", kv_options=opts))
    conn.send(server.start())
    conn.recv()
    server.stop(grace=1)


class Proc:
    def __init__(self, role: str, args, pacer: str | None = None, fraction: float = 0.25) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(role, args.model, args.device, pacer, fraction, child),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(600):
            self.proc.kill()
            raise RuntimeError(f"{role} worker did not start")
        import grpc

        from pdserve.proto import worker_pb2_grpc as pb_grpc

        self.channel = grpc.insecure_channel(self.conn.recv())
        self.stub = pb_grpc.WorkerStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        if self.proc.is_alive():
            self.conn.send("stop")
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


def run_pd(p: Proc, d: Proc, prompts, max_tokens: int) -> dict:
    from pdserve.proto import worker_pb2 as pb
    from pdserve.proto.convert import params_to_proto
    from pdserve.sampling_params import SamplingParams

    params = params_to_proto(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    ttft, tpot, kv_bytes, kv_seconds = [], [], 0, 0.0
    for i, prompt in enumerate(prompts):
        rid = f"pd-{time.monotonic_ns()}-{i}"
        t0 = time.perf_counter()
        res = d.stub.Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                               deadline_s=120), timeout=120)
        pre = p.stub.Prefill(pb.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=params, kv_address=res.kv_address,
            transfer_id=res.transfer_id, dst_block_ids=res.block_ids, wire_version=res.wire_version,
            layout=res.layout, deadline_s=120), timeout=240)
        t1 = time.perf_counter()
        n = len(pre.first.token_ids)
        for chunk in d.stub.Decode(pb.DecodeRequest(request_id=rid, first=pre.first), timeout=240):
            n += len(chunk.token_ids)
        t2 = time.perf_counter()
        ttft.append(t1 - t0)
        tpot.append((t2 - t1) / max(n - 1, 1))
        kv_bytes += pre.kv_bytes
        kv_seconds += pre.kv_seconds
    return {"ttft": ttft, "tpot": tpot, "kv_gbps": kv_bytes * 8 / kv_seconds / 1e9 if kv_seconds else 0.0}


def run_colocated(m: Proc, prompts, max_tokens: int) -> dict:
    from pdserve.proto import worker_pb2 as pb
    from pdserve.proto.convert import params_to_proto
    from pdserve.sampling_params import SamplingParams

    params = params_to_proto(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    ttft, tpot = [], []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        first = None
        n = 0
        for chunk in m.stub.Generate(pb.GenerateRequest(request_id=f"co-{time.monotonic_ns()}-{i}",
                                                        prompt_token_ids=prompt, params=params), timeout=240):
            if first is None and len(chunk.token_ids):
                first = time.perf_counter()
            n += len(chunk.token_ids)
        t2 = time.perf_counter()
        ttft.append(first - t0)
        tpot.append((t2 - first) / max(n - 1, 1))
    return {"ttft": ttft, "tpot": tpot}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3.2-1b")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--gbps", type=float, nargs="+", default=[1, 10, 25, 100])
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench_pd_ttft: --device cuda but no CUDA GPU here (use --device cpu)", file=sys.stderr)
            return 2
    if any(g <= 0 for g in args.gbps):
        p.error("--gbps values must be > 0")
    from pdserve.loaders import load_model_source

    vocab = load_model_source(args.model).config.vocab_size
    rng = random.Random(0)
    # distinct prompts: no prefix-cache hits across requests
    prompts = [[rng.randrange(1, min(vocab, 30000)) for _ in range(args.prompt_len)]
               for _ in range(args.requests + 1)]
    rows = []
    mixed = Proc("mixed", args)
    try:
        run_colocated(mixed, prompts[:1], 4)  # warm-up
        colo = run_colocated(mixed, prompts[1:], args.max_tokens)
    finally:
        mixed.close()
    rows.append({"mode": "colocated", "gbps": None, **_summary(colo)})
    decode = Proc("decode", args)
    try:
        for gbps in args.gbps:
            prefill = Proc("prefill", args, pacer=f"default={gbps:g}")
            try:
                run_pd(prefill, decode, prompts[:1], 4)  # warm-up (and the UCX connection)
                res = run_pd(prefill, decode, prompts[1:], args.max_tokens)
            finally:
                prefill.close()
            rows.append({"mode": "disaggregated", "gbps": gbps, "kv_gbps": res["kv_gbps"], **_summary(res)})
    finally:
        decode.close()
    print(f"model {args.model} on {args.device}, prompt {args.prompt_len} tokens, {args.requests} requests, "
          f"{args.max_tokens} output tokens, one at a time; KV link paced by a token bucket")
    print(f"{'mode':15}{'set Gbit/s':>11}{'KV Gbit/s':>11}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'TPOT ms':>9}"
          f"{'TTFT/colo':>11}")
    base = rows[0]["ttft_p50"]
    for r in rows:
        set_rate = "-" if r["gbps"] is None else f"{r['gbps']:g}"
        kv = "-" if "kv_gbps" not in r else f"{r['kv_gbps']:.2f}"
        print(f"{r['mode']:15}{set_rate:>11}{kv:>11}{r['ttft_p50'] * 1e3:13.1f}{r['ttft_p90'] * 1e3:13.1f}"
              f"{r['tpot_mean'] * 1e3:9.2f}{r['ttft_p50'] / base:10.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


def _summary(res: dict) -> dict:
    ttft = sorted(res["ttft"])
    return {"ttft_p50": statistics.median(ttft), "ttft_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "tpot_mean": statistics.mean(res["tpot"])}


if __name__ == "__main__":
    sys.exit(main())
