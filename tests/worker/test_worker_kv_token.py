"""The KV plane of real workers carries the cluster token (kvtransfer.auth): a prefill worker of
the same cluster moves KV to a decode worker over UCX (loopback) and the tokens come out as the
single-process engine's; a prefill worker of another cluster (another token) is refused by the
decode worker's KV listener, its Prefill fails naming the reason, and nothing lands."""

from __future__ import annotations

import multiprocessing as mp

import grpc
import pytest

from pdserve.llm import LLM
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.auth import call_metadata, new_token
from pdserve.proto.convert import params_to_proto
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(240)

MODEL = "random:tiny-llama"
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
TOKEN, OTHER = new_token(), new_token()


def _serve(name: str, role: str, token: str, conn) -> None:
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.worker.server import WorkerConfig, WorkerServer

    config = EngineConfig(model=MODEL, device="cpu", dtype="float32", cache=CacheConfig(block_size=16, num_blocks=32),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32))
    server = WorkerServer(WorkerConfig(name, role, config, kv_backend="ucx", cluster_token=token))
    conn.send(server.start())
    conn.recv()  # any message: stop
    stats = server.stats()
    server.stop(grace=1)
    conn.send((stats.num_free_blocks, stats.num_blocks, stats.kv_transfer_bytes))


@pytest.fixture(scope="module")
def workers():
    ctx = mp.get_context("spawn")
    procs = {}
    for name, role, token in (("decode", "decode", TOKEN), ("prefill", "prefill", TOKEN),
                              ("stranger", "prefill", OTHER)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(name, role, token, child), daemon=True)
        proc.start()
        procs[name] = (proc, parent)
    addresses = {}
    for name, (proc, parent) in procs.items():
        if not parent.poll(120):
            proc.kill()
            pytest.fail(f"{name} worker did not start")
        addresses[name] = parent.recv()
    yield {name: pb_grpc.WorkerStub(grpc.insecure_channel(address)) for name, address in addresses.items()}, procs
    for proc, conn in procs.values():
        if proc.is_alive():
            conn.send("stop")
            proc.join(30)
        if proc.is_alive():
            proc.kill()


def _prefill(stubs, prefill: str, token: str, rid: str, prompt: list[int]):
    res = stubs["decode"].Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                                    params=params_to_proto(PARAMS), deadline_s=20),
                                  timeout=20, metadata=call_metadata(TOKEN))
    pre = stubs[prefill].Prefill(pb.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=params_to_proto(PARAMS), kv_address=res.kv_address,
        transfer_id=res.transfer_id, dst_block_ids=res.block_ids, wire_version=res.wire_version,
        layout=res.layout, deadline_s=20), timeout=60, metadata=call_metadata(token))
    return pre


def test_kv_moves_only_between_workers_of_one_cluster(workers):
    stubs, procs = workers
    prompt = list(range(3, 40))
    with pytest.raises(grpc.RpcError) as err:
        _prefill(stubs, "stranger", OTHER, "stranger-0", prompt)
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "KV peer refused: cluster token mismatch" in err.value.details()
    stubs["decode"].Abort(pb.AbortRequest(request_id="stranger-0"), timeout=10, metadata=call_metadata(TOKEN))

    expected = LLM(MODEL, device="cpu", dtype="float32", num_blocks=32).generate([prompt], PARAMS)[0].token_ids
    pre = _prefill(stubs, "prefill", TOKEN, "same-0", prompt)
    tokens = list(pre.first.token_ids)
    for chunk in stubs["decode"].Decode(pb.DecodeRequest(request_id="same-0", first=pre.first), timeout=60,
                                        metadata=call_metadata(TOKEN)):
        tokens.extend(chunk.token_ids)
    assert tokens == expected
    moved = {}
    for name, (proc, conn) in procs.items():
        conn.send("stop")
        free, total, moved[name] = conn.recv()
        assert free == total, name  # every block back, the refused transfer's too
        proc.join(30)
    assert moved["decode"] == moved["prefill"] == pre.kv_bytes > 0  # the stranger's bytes never landed
    assert moved["stranger"] == 0
