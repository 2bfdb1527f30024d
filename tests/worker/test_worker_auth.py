"""The locked request plane: a worker built with a cluster token refuses every call without
it, or with another, with UNAUTHENTICATED and a message that says why; the router's client
sends it; the token never shows in a config's repr or the worker's log."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.auth import METADATA_KEY, TOKEN_ENV, new_token, resolve_token
from pdserve.proto.convert import params_to_proto
from pdserve.sampling_params import SamplingParams
from pdserve.worker.server import WorkerConfig, WorkerServer
from pdserve.router.errors import WorkerFailed
from pdserve.router.cluster.worker_client import WorkerClient

TOKEN = new_token()
PARAMS = params_to_proto(SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))


@pytest.fixture(scope="module")
def worker():
    engine = EngineConfig(model="random:tiny-qwen2", device="cpu", dtype="float32",
                          cache=CacheConfig(block_size=4, num_blocks=32))
    server = WorkerServer(WorkerConfig("locked-0", "mixed", engine, kv_backend="fake", cluster_token=TOKEN))
    address = server.start()
    yield address, server
    server.stop()


def _code_and_details(call):
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


@pytest.mark.parametrize("metadata, reason", [
    (None, "missing cluster token"),
    (((METADATA_KEY, "x" * 43),), "wrong cluster token"),
    (((METADATA_KEY, TOKEN[:-1]),), "wrong cluster token"),
    ((("authorization", f"Bearer {TOKEN}"),), "missing cluster token"),
])
def test_calls_without_the_token_are_refused(worker, metadata, reason):
    address, server = worker
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        for call in (
            lambda: stub.Health(pb.HealthRequest(), timeout=5, metadata=metadata),
            lambda: stub.Abort(pb.AbortRequest(request_id="x"), timeout=5, metadata=metadata),
            lambda: list(stub.Generate(pb.GenerateRequest(request_id="g", prompt_token_ids=[1, 2], params=PARAMS),
                                       timeout=5, metadata=metadata)),
        ):
            code, details = _code_and_details(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert reason in details and METADATA_KEY in details
            assert TOKEN not in details
    assert not server.engine.requests  # nothing reached the engine


def test_calls_with_the_token_are_served(worker):
    address, server = worker
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        md = ((METADATA_KEY, TOKEN),)
        assert stub.Health(pb.HealthRequest(), timeout=5, metadata=md).healthy
        chunks = list(stub.Generate(pb.GenerateRequest(request_id="ok", prompt_token_ids=[1, 2], params=PARAMS),
                                    timeout=20, metadata=md))
        assert sum(len(c.token_ids) for c in chunks) == 3


def test_router_client_sends_the_token(worker):
    address, _ = worker

    async def main():
        good = WorkerClient("locked-0", address, cluster_token=TOKEN)
        bad = WorkerClient("locked-0", address)
        try:
            assert (await good.health()).healthy
            with pytest.raises(WorkerFailed, match="UNAUTHENTICATED.*missing cluster token"):
                await bad.health()
        finally:
            await good.close()
            await bad.close()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_token_stays_out_of_reprs_and_logs(caplog):
    caplog.set_level(logging.DEBUG)
    config = WorkerConfig("w", "mixed", EngineConfig(model="random:tiny-qwen2", device="cpu"), kv_backend="fake",
                          cluster_token=TOKEN)
    assert TOKEN not in repr(config)
    from pdserve.launcher.cluster.pools import PoolSpec
    from pdserve.launcher.cluster.serving import RouterSettings

    assert TOKEN not in repr(PoolSpec("mixed", 1, config.engine, cluster_token=TOKEN))
    assert TOKEN not in repr(RouterSettings(model="m", cluster_token=TOKEN))
    server = WorkerServer(config)
    server.start()
    server.stop()
    assert "serving on" in caplog.text and TOKEN not in caplog.text


def test_resolve_token(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert resolve_token(str(path), {}) == TOKEN
    assert resolve_token(str(path), {TOKEN_ENV: "ignored-because-the-file-wins"}) == TOKEN
    assert resolve_token(None, {TOKEN_ENV: TOKEN}) == TOKEN
    assert resolve_token(None, {}) is None
    with pytest.raises(ValueError, match=r"--cluster-token-file: cannot read .*nope"):
        resolve_token(str(tmp_path / "nope"), {})
    path.write_text("short")
    with pytest.raises(ValueError, match=r"--cluster-token-file .*at least 16 characters"):
        resolve_token(str(path), {})
    with pytest.raises(ValueError, match=rf"\${TOKEN_ENV}: .*at least 16"):
        resolve_token(None, {TOKEN_ENV: "abc"})
    with pytest.raises(ValueError, match="cluster_token"):
        WorkerConfig("w", "mixed", cluster_token="short")
