"""Freeing a request's blocks survives the caller going away (issue 30, the kv-loss row's leak).

The worker frees a request on its engine thread, between steps. When the router's call ends
first (its RPC timeout: the engine is busy with a long step on a loaded CPU), the handler is
cancelled while it waits for that command; the command must still run, or the request keeps
its blocks for good (a decode worker's reservation is no longer leased once claimed; a prefill
worker has no lease at all). Here the engine thread is held busy by the test at the moment the
cleanup is queued, and the caller's deadline passes meanwhile: every block must come back.
KV over the in-process fake backend."""

from __future__ import annotations

import threading

import grpc
import pytest

from pdserve.kvtransfer import KVTransferTimeout
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.convert import params_to_proto
from pdserve.worker.server import WorkerConfig, WorkerServer
from tests.router.conftest import wait_until
from tests.worker.test_worker_server import GREEDY, engine_config, prompts


@pytest.fixture(scope="module")
def workers():
    servers, stubs = {}, {}
    try:
        for role in ("prefill", "decode"):
            server = WorkerServer(WorkerConfig(f"{role}-cleanup", role, engine_config(), kv_backend="fake"))
            stubs[role] = pb_grpc.WorkerStub(grpc.insecure_channel(server.start()))
            servers[role] = server
        yield stubs, servers
    finally:
        for server in servers.values():
            server.stop(grace=1)


def hold_engine(server: WorkerServer) -> threading.Event:
    """Keeps `server`'s engine thread busy (as a long step would) until the event is set."""
    busy, done = threading.Event(), threading.Event()
    server.loop.submit(lambda e: (busy.set(), done.wait(10)))
    assert busy.wait(5)
    return done


def all_free(server: WorkerServer) -> bool:
    bm = server.engine.block_manager
    return not server.engine.requests and bm.num_free_blocks == bm.num_blocks


def reserve(stubs, rid: str, prompt):
    return stubs["decode"].Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                                     params=params_to_proto(GREEDY), deadline_s=30), timeout=10)


def test_an_abort_whose_caller_timed_out_still_frees_the_reservation(workers):
    stubs, servers = workers
    decode = servers["decode"]
    reserve(stubs, "abort-late", prompts(1, seed=5)[0])
    assert not all_free(decode)
    done = hold_engine(decode)
    try:
        with pytest.raises(grpc.RpcError) as err:  # the router's Abort gives up first
            stubs["decode"].Abort(pb.AbortRequest(request_id="abort-late"), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        done.set()
    # the reservation was claimed by the Abort (no lease frees it any more): the Abort must finish
    assert wait_until(lambda: all_free(decode), timeout_s=5), decode.engine.requests


def test_a_prefill_whose_caller_timed_out_while_releasing_frees_its_blocks(workers, monkeypatch):
    stubs, servers = workers
    prefill, decode = servers["prefill"], servers["decode"]
    prompt = prompts(1, seed=6)[0]
    res = reserve(stubs, "release-late", prompt)
    holds: list[threading.Event] = []

    def late_transfer(transfer_id, timeout):
        # the transfer missed its deadline, and the engine is busy when the prefill worker frees the request
        holds.append(hold_engine(prefill))
        raise KVTransferTimeout(f"transfer {transfer_id!r} not acknowledged (test)")

    monkeypatch.setattr(prefill.sender, "finish", late_transfer)
    try:
        with pytest.raises(grpc.RpcError) as err:  # the router's Prefill RPC times out during the release
            stubs["prefill"].Prefill(pb.PrefillRequest(
                request_id="release-late", prompt_token_ids=prompt, params=params_to_proto(GREEDY),
                kv_address=res.kv_address, transfer_id=res.transfer_id, dst_block_ids=res.block_ids,
                wire_version=res.wire_version, layout=res.layout, deadline_s=30), timeout=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert holds, "the prefill did not reach its transfer"
    finally:
        for done in holds:
            done.set()
    assert wait_until(lambda: all_free(prefill), timeout_s=5), prefill.engine.requests
    stubs["decode"].Abort(pb.AbortRequest(request_id="release-late"), timeout=10)
    assert wait_until(lambda: all_free(decode), timeout_s=5)


class _LateContext:
    """A call that reaches the worker after its caller gave up (the worker was stopped while the
    call waited in its socket): its deadline has passed. `abort` raises as grpc's does."""

    def __init__(self, remaining_after_grant: float | None = -1.0, remaining_at_start: float | None = -1.0):
        self.remaining = [remaining_at_start, remaining_after_grant]
        self.aborted: tuple | None = None

    def cancelled(self) -> bool:
        return False

    def time_remaining(self):
        return self.remaining.pop(0) if len(self.remaining) > 1 else self.remaining[0]

    async def abort(self, code, message):
        self.aborted = (code, message)
        raise grpc.RpcError(message)


@pytest.mark.parametrize("start, after", [(-1.0, -1.0), (5.0, -1.0)], ids=["late-arrival", "granted-late"])
def test_a_reserve_whose_caller_gave_up_holds_no_blocks(workers, start, after):
    import asyncio

    from pdserve.worker.servicer import WorkerServicer

    _, servers = workers
    decode = servers["decode"]
    assert wait_until(lambda: all_free(decode), timeout_s=5)
    context = _LateContext(remaining_after_grant=after, remaining_at_start=start)
    request = pb.ReserveRequest(request_id=f"late-{start}", prompt_token_ids=prompts(1, seed=7)[0],
                                params=params_to_proto(GREEDY), deadline_s=30)

    async def call():
        with pytest.raises(grpc.RpcError):
            await WorkerServicer(decode).Reserve(request, context)

    asyncio.run(call())
    assert context.aborted is not None and context.aborted[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: all_free(decode), timeout_s=5), decode.engine.requests
    assert f"late-{start}" not in decode.transfers
