"""What streaming tokens costs a worker process besides its engine: CPU per streamed token.

    python3 -m benchmarks.bench_worker_streaming [--streams 64] [--tokens 200] [--rounds 3]

Starts a real `WorkerServer` (mixed role, gRPC) on a tiny random model on the CPU, opens
`--streams` concurrent Generate calls of `--tokens` tokens each from a grpc.aio client in
another process, and reads the worker's own counters (Stats): the engine thread's CPU time
and the whole process's. The difference is what the rest of the worker (the asyncio thread
handing each step's outputs to the calls, building and sending one gRPC message per token, the
gRPC threads) took, and on a GPU worker it competes with the engine thread for the GIL. Prints
the median over rounds of that CPU per streamed token (microseconds) and of the engine
thread's, and the tokens per second delivered.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time


def _serve(queue, model: str, streams: int) -> None:
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.worker.server import WorkerConfig, WorkerServer

    engine = EngineConfig(model=model, device="cpu", dtype="float32",
                          cache=CacheConfig(block_size=16, num_blocks=4096),
                          scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max(streams, 1)))
    server = WorkerServer(WorkerConfig("bench-0", "mixed", engine, kv_backend="fake"))
    queue.put(server.start())
    try:
        while True:
            time.sleep(1)
    finally:
        server.stop()


async def _round(address: str, streams: int, tokens: int, seq: int) -> tuple[float, int, float, float]:
    import grpc

    from pdserve.proto import worker_pb2 as pb
    from pdserve.proto import worker_pb2_grpc as pb_grpc
    from pdserve.proto.convert import params_to_proto
    from pdserve.sampling_params import SamplingParams

    params = params_to_proto(SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        before = await stub.Stats(pb.StatsRequest())

        async def one(i: int) -> int:
            n = 0
            call = stub.Generate(pb.GenerateRequest(request_id=f"b{seq}-{i}", prompt_token_ids=[1 + i % 50] * 16,
                                                    params=params))
            async for chunk in call:
                n += len(chunk.token_ids)
            return n

        t = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(streams)))
        seconds = time.perf_counter() - t
        after = await stub.Stats(pb.StatsRequest())
    engine = after.engine_cpu_seconds - before.engine_cpu_seconds
    process = after.process_cpu_seconds - before.process_cpu_seconds
    return seconds, sum(counts), engine, process - engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="random:tiny-llama")
    args = p.parse_args(argv)
    for name in ("streams", "tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(queue, args.model, args.streams), daemon=True)
    proc.start()
    try:
        address = queue.get(timeout=120)
        asyncio.run(_round(address, min(4, args.streams), 8, -1))  # warm-up
        results = [asyncio.run(_round(address, args.streams, args.tokens, k)) for k in range(args.rounds)]
    finally:
        proc.terminate()
        proc.join(10)
    rest = statistics.median(r[3] / r[1] * 1e6 for r in results)
    engine = statistics.median(r[2] / r[1] * 1e6 for r in results)
    rate = statistics.median(r[1] / r[0] for r in results)
    print(f"{args.streams} streams x {args.tokens} tokens ({args.model}, CPU): {rate:,.0f} tokens/s delivered; "
          f"CPU per streamed token: engine thread {engine:.1f} us, the rest of the worker {rest:.1f} us "
          f"(median of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
