"""Leases: a decode worker that stops answering (SIGSTOP) holds nothing of its peers', and drops
what it no longer owns when it wakes. Real prefill and decode worker processes, UCX loopback,
a 2 s KV deadline and a 1 s reservation grace."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import warnings

import grpc
import pytest

from pdserve.llm import LLM
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.convert import params_to_proto
from tests.worker.test_worker_ucx import MODEL, PARAMS

DEADLINE_S = 2.0


def _serve(role: str, conn) -> None:
    import faulthandler

    faulthandler.enable()  # a crash of this worker prints its stacks into the test's output
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.worker.server import WorkerConfig, WorkerServer

    config = EngineConfig(model=MODEL, device="cpu", dtype="float32",
                          cache=CacheConfig(block_size=16, num_blocks=128),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32))
    server = WorkerServer(WorkerConfig(f"{role}-lease", role, config, kv_backend="ucx"),
                          default_deadline_s=DEADLINE_S, reservation_grace_s=1.0)
    conn.send(server.start())
    while conn.recv() == "metrics":
        faulthandler.dump_traceback_later(45)  # a hang here prints where (the test waits 60 s)
        conn.send((server.reservations_expired, (server.sender or server.receiver).metrics()))
        faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(60, exit=True)  # a hang in the stop prints where it hangs
    server.stop(grace=1)
    conn.send("stopped")


def _disaggregated(stubs, rid, prompt):
    res = stubs["decode"].Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                                    params=params_to_proto(PARAMS), deadline_s=DEADLINE_S), timeout=20)
    pre = stubs["prefill"].Prefill(pb.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=params_to_proto(PARAMS), kv_address=res.kv_address,
        transfer_id=res.transfer_id, dst_block_ids=res.block_ids, wire_version=res.wire_version,
        layout=res.layout, deadline_s=DEADLINE_S), timeout=30)
    tokens = list(pre.first.token_ids)
    for chunk in stubs["decode"].Decode(pb.DecodeRequest(request_id=rid, first=pre.first), timeout=30):
        tokens.extend(chunk.token_ids)
    return tokens


def _free(stub) -> tuple[int, int]:
    s = stub.Stats(pb.StatsRequest(), timeout=10)
    return s.num_free_blocks, s.num_blocks


@pytest.mark.timeout(240)
def test_stopped_receiver_releases_by_lease_and_drops_stale_transfers():
    ctx = mp.get_context("spawn")
    procs = {}
    try:
        for role in ("prefill", "decode"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(role, child), daemon=True)
            proc.start()
            child.close()  # the worker holds the only other end: its death reads as EOF, not a hang
            assert parent.poll(120), f"{role} worker did not start"
            procs[role] = (proc, parent, parent.recv())
        stubs = {role: pb_grpc.WorkerStub(grpc.insecure_channel(addr)) for role, (_, _, addr) in procs.items()}
        prompts = [list(range(5, 5 + 70)), list(range(9, 9 + 40)), list(range(30, 30 + 90))]
        expected = [o.token_ids
                    for o in LLM(MODEL, device="cpu", dtype="float32", num_blocks=128).generate(prompts, PARAMS)]
        assert _disaggregated(stubs, "warm", prompts[0]) == expected[0]  # the KV link is up

        decode_pid = procs["decode"][0].pid
        res = stubs["decode"].Reserve(pb.ReserveRequest(request_id="stopped", prompt_token_ids=prompts[1],
                                                        params=params_to_proto(PARAMS), deadline_s=DEADLINE_S),
                                      timeout=20)
        os.kill(decode_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as info:
                stubs["prefill"].Prefill(pb.PrefillRequest(
                    request_id="stopped", prompt_token_ids=prompts[1], params=params_to_proto(PARAMS),
                    kv_address=res.kv_address, transfer_id=res.transfer_id, dst_block_ids=res.block_ids,
                    wire_version=res.wire_version, layout=res.layout, deadline_s=DEADLINE_S), timeout=30)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
            assert time.monotonic() - stopped_at < DEADLINE_S + 3  # the sender's lease, not the receiver, ended it
            free, total = _free(stubs["prefill"])
            assert free == total  # the prefill worker holds nothing for the stopped receiver
            time.sleep(max(0.0, stopped_at + DEADLINE_S + 1.0 + 2.0 - time.monotonic()))  # past the lease
        finally:
            os.kill(decode_pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while _free(stubs["decode"])[0] != _free(stubs["decode"])[1] and time.monotonic() < deadline:
            time.sleep(0.2)
        free, total = _free(stubs["decode"])
        assert free == total  # the woken receiver dropped the reservation it no longer owns
        first = pb.TokenChunk(token_ids=[1])
        with pytest.raises(grpc.RpcError) as late:
            list(stubs["decode"].Decode(pb.DecodeRequest(request_id="stopped", first=first), timeout=10))
        assert late.value.code() == grpc.StatusCode.NOT_FOUND
        assert _disaggregated(stubs, "after", prompts[2]) == expected[2]  # the link serves again
        results = {}
        for role, (proc, conn, _) in procs.items():  # both asked before either stops
            conn.send("metrics")
            assert conn.poll(60), f"the {role} worker did not answer (exit code {proc.exitcode})"
            results[role] = conn.recv()
        expired, metrics = results["decode"]
        assert expired == 1
        assert metrics["transfers_expired"] + metrics["transfers_cancelled"] >= 1
        for role, (proc, conn, _) in procs.items():
            conn.send("stop")
            if not conn.poll(90):  # not this test's subject: reported, and the finally kills it
                warnings.warn(f"the {role} worker did not stop within 90 s (exit code {proc.exitcode})")
            proc.join(30)
    finally:
        for proc, _, _ in procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
