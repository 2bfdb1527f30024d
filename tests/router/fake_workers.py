"""Fake gRPC workers for the cluster backend tests: in-process grpc.aio servers on loopback.

Tokens are deterministic by position: the j-th generated token of a prompt is
`token_at(prompt, j, seed)` (letters, as conftest.expected_text), whoever computes it, so a
request that migrates mid-stream still produces the uninterrupted text. KV "transfer": Prefill
puts the prompt in the cluster's shared `kv` dict under the transfer id that Reserve handed
out; Decode fails with DEADLINE_EXCEEDED if it is not there.

`Script` steers one worker: delays, errors per RPC, "die" (stop the server) at a point, health.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.sampling_params import SamplingParams
from pdserve.proto.convert import params_from_proto
from pdserve.router.cluster.directory import WorkerEndpoint

PREFILL_KV_BYTES_PER_TOKEN = 1000


# what the fake's Generate reports for the worker's part of a first token: queue, prefill, hand-off
FIRST_TOKEN_TIMING = (0.003, 0.004, 0.0005)


def token_at(prompt: list[int], j: int, seed: int | None = None) -> int:
    return ord("a") + (sum(prompt) + (seed or 0) + j) % 26


def expected_tokens(prompt: list[int], n: int, seed: int | None = None) -> list[int]:
    return [token_at(prompt, j, seed) for j in range(n)]


@dataclass
class Script:
    step_delay_s: float = 0.0  # before each generated token of Generate/Decode
    prefill_delay_s: float = 0.0
    reserve_error: grpc.StatusCode | None = None
    prefill_error: grpc.StatusCode | None = None
    generate_error: grpc.StatusCode | None = None
    die_in_prefill: bool = False  # stop the server while Prefill runs
    die_after_tokens: int | None = None  # stop the server once this many tokens were streamed by Generate/Decode
    push_kv: bool = True  # Prefill "pushes" the KV to D (False: D's Decode misses the deadline)
    healthy: bool = True  # what Health answers
    hang: bool = False  # Health, Stats and token streams stop answering (a hung process)
    hang_aborts: bool = False  # Abort does not answer (a stopped process); the caller's timeout drops it unserved
    kv_compat: str = ""  # what Stats reports as the worker's KV compatibility key


@dataclass
class Cluster:
    """State shared by the fake workers of one test: the KV "wire"."""

    kv: dict[str, list[int]] = field(default_factory=dict)


class FakeWorker(pb_grpc.WorkerServicer):
    def __init__(self, worker_id: str, role: str, cluster: Cluster, script: Script | None = None,
                 node: str = "") -> None:
        self.worker_id = worker_id
        self.role = role
        self.node = node
        self.cluster = cluster
        self.script = script or Script()
        self.calls: list[tuple[str, str]] = []  # (method, request id)
        self.aborts: list[str] = []
        self.generate_requests: list[pb.GenerateRequest] = []
        self.reservations: dict[str, tuple[list[int], SamplingParams, str]] = {}  # id -> (prompt, params, transfer id)
        self.live: set[str] = set()
        self.server: grpc.aio.Server | None = None
        self.port = 0

    # ---------------------------------------------------------------- lifecycle

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> WorkerEndpoint:
        return WorkerEndpoint(self.worker_id, self.role, self.address, self.node)  # type: ignore[arg-type]

    async def start(self, port: int = 0) -> FakeWorker:
        self.server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        assert self.port, "could not bind"
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            await server.stop(None)

    def _die(self) -> None:
        asyncio.get_running_loop().create_task(self.stop())

    def called(self, method: str) -> list[str]:
        return [rid for m, rid in self.calls if m == method]

    # ---------------------------------------------------------------- RPCs

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.calls.append(("Generate", request.request_id))
        self.generate_requests.append(request)
        if self.script.generate_error is not None:
            await context.abort(self.script.generate_error, f"scripted {self.script.generate_error.name}")
        prompt, resumed = list(request.prompt_token_ids), list(request.resumed_token_ids)
        params = params_from_proto(request.params)
        async for chunk in self._stream(request.request_id, prompt, params, start=len(resumed), first_timing=True):
            yield chunk

    async def Reserve(self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext) -> pb.ReserveResponse:
        self.calls.append(("Reserve", request.request_id))
        if self.role == "prefill":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a prefill worker does not reserve")
        if self.script.reserve_error is not None:
            await context.abort(self.script.reserve_error, f"scripted {self.script.reserve_error.name}")
        transfer_id = f"{self.worker_id}/{request.request_id}"
        params = params_from_proto(request.params)
        self.reservations[request.request_id] = (list(request.prompt_token_ids), params, transfer_id)
        num_blocks = -(-len(request.prompt_token_ids) // 4)
        return pb.ReserveResponse(
            kv_address=f"fake://{self.worker_id}", transfer_id=transfer_id, block_ids=list(range(num_blocks)),
            wire_version=1, layout="fake-layout",
        )

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        self.calls.append(("Prefill", request.request_id))
        self.live.add(request.request_id)
        try:
            if self.script.die_in_prefill:
                self._die()
                await asyncio.sleep(30)
            await asyncio.sleep(self.script.prefill_delay_s)
            if self.script.prefill_error is not None:
                await context.abort(self.script.prefill_error, f"scripted {self.script.prefill_error.name}")
            assert request.layout == "fake-layout" and request.wire_version == 1, request
            prompt = list(request.prompt_token_ids)
            if self.script.push_kv:
                self.cluster.kv[request.transfer_id] = prompt
            params = params_from_proto(request.params)
            token = token_at(prompt, 0, params.seed)
            finished = params.max_tokens == 1
            first = pb.TokenChunk(
                request_id=request.request_id, token_ids=[token], text=chr(token), finished=finished,
                finish_reason="length" if finished else "", num_prompt_tokens=len(prompt), num_output_tokens=1,
            )
            full = len(prompt) * PREFILL_KV_BYTES_PER_TOKEN
            kv_bytes = full * 18 // 32 if request.kv_precision == "fp8" else full  # FP8: bf16's 18/32
            return pb.PrefillResponse(
                first=first, kv_bytes=kv_bytes, kv_seconds=0.002,
                queue_seconds=0.0, prefill_seconds=0.001, kv_phases={"wire": 0.0015, "link": 0.001},
                kv_link_bytes=kv_bytes // 2, kv_precision=request.kv_precision or "full",
                kv_bytes_saved=full - kv_bytes,
            )
        finally:
            self.live.discard(request.request_id)

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        self.calls.append(("Decode", request.request_id))
        reservation = self.reservations.pop(request.request_id, None)
        if reservation is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no reservation for {request.request_id}")
        prompt, params, transfer_id = reservation
        if self.cluster.kv.get(transfer_id) != prompt:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the KV of {request.request_id} did not land")
        assert list(request.first.token_ids) == [token_at(prompt, 0, params.seed)], request.first
        async for chunk in self._stream(request.request_id, prompt, params, start=1):
            yield chunk

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        while self.script.hang_aborts:  # cancelled when the caller gives up: this Abort is never served
            await asyncio.sleep(0.01)
        self.calls.append(("Abort", request.request_id))
        self.aborts.append(request.request_id)
        found = request.request_id in self.live or request.request_id in self.reservations
        self.reservations.pop(request.request_id, None)
        return pb.AbortResponse(found=found)

    async def _hang_if_scripted(self) -> None:
        while self.script.hang:
            await asyncio.sleep(0.01)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        await self._hang_if_scripted()
        return pb.StatsResponse(
            worker_id=self.worker_id, role=self.role, num_running=len(self.live),
            num_awaiting_kv=len(self.reservations), num_blocks=1024, num_free_blocks=1024, block_size=4,
            model="fake-model", max_model_len=4096, kv_compat=self.script.kv_compat,
        )

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        await self._hang_if_scripted()
        return pb.HealthResponse(healthy=self.script.healthy, worker_id=self.worker_id, role=self.role,
                                 detail="" if self.script.healthy else "scripted unhealthy")

    # ---------------------------------------------------------------- token streams

    async def _stream(self, request_id: str, prompt: list[int], params: SamplingParams, *, start: int,
                      first_timing: bool = False):
        """Tokens at positions start.. max_tokens-1, one per step; "abort" once Abort arrives.
        `first_timing` (Generate): the first chunk reports the worker's part of its first token
        as FIRST_TOKEN_TIMING, as a real worker does."""
        self.live.add(request_id)
        aborts_before = self.aborts.count(request_id)
        streamed = 0
        try:
            for j in range(start, params.max_tokens):
                await asyncio.sleep(self.script.step_delay_s)
                await self._hang_if_scripted()
                if self.aborts.count(request_id) > aborts_before:
                    yield pb.TokenChunk(request_id=request_id, finished=True, finish_reason="abort",
                                        num_prompt_tokens=len(prompt), num_output_tokens=j)
                    return
                if self.script.die_after_tokens is not None and streamed >= self.script.die_after_tokens:
                    self._die()
                    await asyncio.sleep(30)
                token = token_at(prompt, j, params.seed)
                finished = j == params.max_tokens - 1
                streamed += 1
                chunk = pb.TokenChunk(
                    request_id=request_id, token_ids=[token], text=chr(token), finished=finished,
                    finish_reason="length" if finished else "", num_prompt_tokens=len(prompt), num_output_tokens=j + 1,
                )
                if first_timing and streamed == 1:
                    queue, prefill, handoff = FIRST_TOKEN_TIMING
                    chunk.queue_seconds, chunk.prefill_seconds, chunk.handoff_seconds = queue, prefill, handoff
                yield chunk
        finally:
            self.live.discard(request_id)


class MutableDirectory:
    """A directory whose entries a test changes (a worker restarting at a new address)."""

    def __init__(self, endpoints: list[WorkerEndpoint]) -> None:
        self.entries = list(endpoints)

    async def endpoints(self) -> list[WorkerEndpoint]:
        return list(self.entries)

    def update(self, endpoint: WorkerEndpoint) -> None:
        self.entries = [endpoint if e.worker_id == endpoint.worker_id else e for e in self.entries]
