"""KV faults between real prefill and decode worker processes (UCX loopback): with messages
dropped, duplicated, reordered and corrupted by the prefill worker's sender (kvtransfer.faults),
every request still gives the single-process engine's greedy tokens: a transfer that went wrong
is refused by the decode worker (DATA_LOSS: checksum; DEADLINE_EXCEEDED: lost messages) and the
prompt is prefilled again there (the router's fallback, done here by hand); every block is freed.
Then the router's `replace` path: a Prefill whose caller gives up early (its RPC timeout) while
the transfer is under way, and Aborts that give up early too: every block is still freed, within
the reservation lease at the latest."""

from __future__ import annotations

import multiprocessing as mp
import time

import grpc
import pytest

from pdserve.llm import LLM
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.convert import params_to_proto
from tests.worker.test_worker_ucx import MODEL, PARAMS, twenty_prompts

FAULTS = "drop=0.04,duplicate=0.1,reorder=0.1,corrupt=0.1,seed=3"
DEADLINE_S = 2.0


def _serve(role: str, conn) -> None:
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.worker.server import WorkerConfig, WorkerServer

    config = EngineConfig(model=MODEL, device="cpu", dtype="float32",
                          cache=CacheConfig(block_size=16, num_blocks=128),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32))
    options = (("faults", FAULTS),) if role == "prefill" else ()
    server = WorkerServer(WorkerConfig(f"{role}-faults", role, config, kv_backend="ucx", kv_options=options),
                          default_deadline_s=DEADLINE_S)
    conn.send(server.start())
    conn.recv()
    # what an Abort that never arrived left is freed by the reservation's lease (deadline + grace)
    end = time.monotonic() + DEADLINE_S + server.reservation_grace_s + 5
    while server.stats().num_free_blocks != server.stats().num_blocks and time.monotonic() < end:
        time.sleep(0.2)
    stats = server.stats()
    metrics = (server.sender or server.receiver).metrics()
    server.stop(grace=1)
    conn.send((stats.num_free_blocks, stats.num_blocks, metrics))


@pytest.mark.timeout(300)
def test_faulty_kv_link_never_changes_greedy_output():
    ctx = mp.get_context("spawn")
    procs = {}
    try:
        for role in ("prefill", "decode"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(role, child), daemon=True)
            proc.start()
            assert parent.poll(120), f"{role} worker did not start"
            procs[role] = (proc, parent, parent.recv())
        stubs = {role: pb_grpc.WorkerStub(grpc.insecure_channel(addr)) for role, (_, _, addr) in procs.items()}
        batch = twenty_prompts()
        expected = [o.token_ids
                    for o in LLM(MODEL, device="cpu", dtype="float32", num_blocks=128).generate(batch, PARAMS)]
        statuses = []
        for i, prompt in enumerate(batch):
            rid = f"f-{i}"
            res = stubs["decode"].Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                                            params=params_to_proto(PARAMS), deadline_s=DEADLINE_S),
                                          timeout=20)
            try:
                pre = stubs["prefill"].Prefill(pb.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, params=params_to_proto(PARAMS),
                    kv_address=res.kv_address, transfer_id=res.transfer_id, dst_block_ids=res.block_ids,
                    wire_version=res.wire_version, layout=res.layout, deadline_s=DEADLINE_S), timeout=60)
                tokens = list(pre.first.token_ids)
                for chunk in stubs["decode"].Decode(pb.DecodeRequest(request_id=rid, first=pre.first), timeout=60):
                    tokens.extend(chunk.token_ids)
                statuses.append("OK")
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.DEADLINE_EXCEEDED), e
                statuses.append(e.code().name)
                stubs["decode"].Abort(pb.AbortRequest(request_id=rid), timeout=20)
                tokens = []
                for chunk in stubs["decode"].Generate(pb.GenerateRequest(
                        request_id=rid + ".1", prompt_token_ids=prompt, params=params_to_proto(PARAMS)), timeout=60):
                    tokens.extend(chunk.token_ids)
            assert tokens == expected[i], (i, statuses[-1])
        assert "OK" in statuses and "DATA_LOSS" in statuses, statuses
        # the replace path: the caller's Prefill and Abort time out mid-way; D prefills it again
        for i, prompt in enumerate(batch[:8]):
            rid = f"r-{i}"
            res = stubs["decode"].Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                                            params=params_to_proto(PARAMS), deadline_s=DEADLINE_S),
                                          timeout=20)
            try:
                stubs["prefill"].Prefill(pb.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, params=params_to_proto(PARAMS),
                    kv_address=res.kv_address, transfer_id=res.transfer_id, dst_block_ids=res.block_ids,
                    wire_version=res.wire_version, layout=res.layout, deadline_s=DEADLINE_S), timeout=0.01 * (i + 1))
            except grpc.RpcError:
                pass  # timed out (or the transfer failed): the router gives up on this pair
            for role in ("prefill", "decode"):
                try:
                    stubs[role].Abort(pb.AbortRequest(request_id=rid), timeout=0.02)
                except grpc.RpcError:
                    pass  # bounded: the router does not wait for it
            tokens = []
            for chunk in stubs["decode"].Generate(pb.GenerateRequest(
                    request_id=rid + ".1", prompt_token_ids=prompt, params=params_to_proto(PARAMS)), timeout=60):
                tokens.extend(chunk.token_ids)
            assert tokens == expected[i], i
        results = {}
        for role, (proc, conn, _) in procs.items():
            conn.send("stop")
            results[role] = conn.recv()
            proc.join(30)
        for role, (free, total, _) in results.items():
            assert free == total, role  # every block back
        assert results["prefill"][2]["faults_injected"] > 0
        assert results["decode"][2]["checksum_failures"] > 0
    finally:
        for proc, _, _ in procs.values():
            if proc.is_alive():
                proc.kill()
