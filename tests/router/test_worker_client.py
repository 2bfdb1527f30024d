"""WorkerClient: gRPC status -> router exceptions, bounded unary calls, cancellation of streams."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.sampling_params import SamplingParams
from pdserve.router.errors import KVTransferDeadline, WorkerFailed, WorkerOverloaded, WorkerRejected
from pdserve.router.cluster.worker_client import Reservation, WorkerClient
from tests.router.fake_workers import Cluster, FakeWorker, Script, expected_tokens

PARAMS = SamplingParams(max_tokens=50)
PROMPT = [1, 2, 3]
RESERVATION = Reservation("fake://x", "x/r", (0,), 1, "fake-layout")


def run(main) -> None:
    asyncio.run(asyncio.wait_for(main(), 20))


async def started(script: Script | None = None, role: str = "mixed") -> tuple[FakeWorker, WorkerClient]:
    worker = await FakeWorker("w", role, Cluster(), script).start()
    return worker, WorkerClient("w", worker.address, rpc_timeout_s=0.3)


@pytest.mark.parametrize("code, exc_type", [
    (grpc.StatusCode.INVALID_ARGUMENT, WorkerRejected),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, WorkerOverloaded),
    (grpc.StatusCode.DEADLINE_EXCEEDED, KVTransferDeadline),
    (grpc.StatusCode.UNAVAILABLE, WorkerFailed),
    (grpc.StatusCode.INTERNAL, WorkerFailed),
])
def test_status_codes_map_to_router_errors(code, exc_type):
    async def main():
        worker, client = await started(Script(prefill_error=code))
        try:
            with pytest.raises(exc_type) as info:
                await client.prefill("r", PROMPT, PARAMS, RESERVATION, 1.0)
            assert info.value.worker_id == "w"
            assert type(info.value) is exc_type
        finally:
            await client.close()
            await worker.stop()
    run(main)


def test_unary_calls_are_bounded_by_their_timeout():
    async def main():
        worker, client = await started(Script(prefill_delay_s=5))
        try:
            start = time.monotonic()
            with pytest.raises(WorkerFailed, match="did not answer Prefill within 0.3 s"):
                await client.prefill("r", PROMPT, PARAMS, RESERVATION, 1.0)
            assert time.monotonic() - start < 1
            worker.script.hang = True
            with pytest.raises(WorkerFailed, match="did not answer Health"):
                await client.health()
        finally:
            worker.script.hang = False
            await client.close()
            await worker.stop()
    run(main)


def test_cancel_calls_ends_a_stream_with_worker_failed():
    async def main():
        worker, client = await started(Script(step_delay_s=0.02))
        try:
            received = []
            with pytest.raises(WorkerFailed, match="cancelled: because"):
                async for output in client.generate("r", PROMPT, PARAMS):
                    received.extend(output.new_token_ids)
                    if len(received) == 2:
                        assert client.cancel_calls("because", "other") == 0
                        assert client.cancel_calls("because", "r") == 1
            assert received == expected_tokens(PROMPT, 2)
            assert client.num_active_calls == 0
        finally:
            await client.close()
            await worker.stop()
    run(main)


def test_dead_and_closed_workers_fail_fast():
    async def main():
        worker, client = await started()
        await worker.stop()
        try:
            with pytest.raises(WorkerFailed, match="UNAVAILABLE"):
                await client.stats()
            await client.close()
            with pytest.raises(WorkerFailed, match="closed"):
                await client.abort("r")
            with pytest.raises(WorkerFailed, match="closed"):
                async for _ in client.generate("r", PROMPT, PARAMS):
                    pass
        finally:
            await client.close()
    run(main)
