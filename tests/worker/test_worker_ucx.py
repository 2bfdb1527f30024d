"""Prefill and decode workers in separate processes, KV over real UCX (loopback), and over NIXL
where it is installed: 20 varied prompts give exactly the single-process engine's greedy tokens."""

from __future__ import annotations

import multiprocessing as mp
import random

import grpc
import pytest

from pdserve.llm import LLM
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.convert import params_to_proto
from pdserve.sampling_params import SamplingParams

MODEL = "random:tiny-llama"
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _nixl_missing() -> str | None:
    from pdserve.kvtransfer.errors import KVTransferError
    from pdserve.kvtransfer.nixl import load_nixl

    try:
        load_nixl()
    except KVTransferError as e:
        return str(e)
    return None


BACKENDS = ["ucx", pytest.param("nixl", marks=pytest.mark.skipif(_nixl_missing() is not None,
                                                                  reason=f"{_nixl_missing()}"))]


def _serve(role: str, backend: str, conn) -> None:
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.worker.server import WorkerConfig, WorkerServer

    config = EngineConfig(model=MODEL, device="cpu", dtype="float32",
                          cache=CacheConfig(block_size=16, num_blocks=128),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32))
    server = WorkerServer(WorkerConfig(f"{role}-{backend}", role, config, kv_backend=backend))
    conn.send(server.start())
    conn.recv()  # any message: stop
    stats = server.stats()
    server.stop(grace=1)
    conn.send((stats.num_free_blocks, stats.num_blocks, stats.kv_transfer_bytes))


@pytest.fixture(scope="module", params=BACKENDS)
def ucx_workers(request):
    ctx = mp.get_context("spawn")
    procs = {}
    for role in ("prefill", "decode"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(role, request.param, child), daemon=True)
        proc.start()
        if not parent.poll(120):
            proc.kill()
            pytest.fail(f"{role} worker did not start")
        procs[role] = (proc, parent, parent.recv())
    stubs = {role: pb_grpc.WorkerStub(grpc.insecure_channel(addr)) for role, (_, _, addr) in procs.items()}
    yield stubs, procs, request.param
    for proc, conn, _ in procs.values():
        if proc.is_alive():
            conn.send("stop")
            proc.join(30)
        if proc.is_alive():
            proc.kill()


def twenty_prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(1, 500) for _ in range(40)]
    out = []
    for i in range(20):
        if i % 4 == 0:  # shares a 40-token prefix with the others of its kind
            out.append(shared + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 9))])
        elif i % 4 == 1:  # longer than a 32-token prefill chunk
            out.append([rng.randrange(1, 500) for _ in range(rng.randrange(70, 130))])
        else:
            out.append([rng.randrange(1, 500) for _ in range(rng.randrange(2, 30))])
    return out


def test_twenty_prompts_token_identical_over_ucx(ucx_workers):
    stubs, procs, backend = ucx_workers
    batch = twenty_prompts()
    reference = LLM(MODEL, device="cpu", dtype="float32", num_blocks=128)
    expected = [o.token_ids for o in reference.generate(batch, PARAMS)]
    kv_bytes = 0
    for i, prompt in enumerate(batch):
        rid = f"ucx-{i}"
        res = stubs["decode"].Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                                        params=params_to_proto(PARAMS), deadline_s=20), timeout=20)
        assert res.kv_address.startswith(f"{backend}://")
        pre = stubs["prefill"].Prefill(pb.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=params_to_proto(PARAMS), kv_address=res.kv_address,
            transfer_id=res.transfer_id, dst_block_ids=res.block_ids, wire_version=res.wire_version,
            layout=res.layout, deadline_s=20), timeout=60)
        kv_bytes += pre.kv_bytes
        tokens = list(pre.first.token_ids)
        for chunk in stubs["decode"].Decode(pb.DecodeRequest(request_id=rid, first=pre.first), timeout=60):
            tokens.extend(chunk.token_ids)
        assert tokens == expected[i], f"prompt {i} ({len(prompt)} tokens)"
    # 2 layers x (K+V) x 2 kv heads x 16 dims x 4 bytes per token, whole blocks of 16 tokens
    per_token = 2 * 2 * 2 * 16 * 4
    assert kv_bytes == sum(-(-len(p) // 16) * 16 for p in batch) * per_token
    for role, (proc, conn, _) in procs.items():
        conn.send("stop")
        free, total, moved = conn.recv()
        assert free == total, role  # every block back
        assert moved == kv_bytes
        proc.join(30)
