"""The router's gRPC client for one worker: typed calls, bounded waits, router exceptions.

Every unary call has a timeout. Streams have none of their own (a decode may wait in a queue);
they end when the worker ends them, fails, or when the owner calls `cancel_calls` (the router
does so when health checks declare the worker dead, or when a request is aborted): a stream
cancelled that way raises WorkerFailed in its reader.

gRPC status -> exception (`pdserve.router.errors.WORKER_STATUS_ERRORS`): INVALID_ARGUMENT ->
WorkerRejected (400), RESOURCE_EXHAUSTED -> WorkerOverloaded (429), DEADLINE_EXCEEDED from the
worker -> KVTransferDeadline, anything else (UNAVAILABLE, CANCELLED, INTERNAL, our own call
timeout) -> WorkerFailed. Each carries `worker_id`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.auth import call_metadata
from pdserve.sampling_params import RequestOutput, SamplingParams
from pdserve.proto.convert import chunk_to_output, output_to_chunk, params_to_proto
from pdserve.router.errors import WORKER_STATUS_ERRORS, WorkerError, WorkerFailed

logger = logging.getLogger(__name__)

# Reconnect quickly to a worker that comes back (gRPC's default backoff grows to 120 s).
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)


@dataclass(frozen=True)
class Reservation:
    """Where a prefill worker pushes the prompt's KV on the decode worker (ReserveResponse)."""

    kv_address: str
    transfer_id: str
    block_ids: tuple[int, ...]
    wire_version: int
    layout: str


@dataclass(frozen=True)
class PrefillResult:
    first: RequestOutput  # the first generated token
    kv_bytes: int
    kv_seconds: float
    queue_seconds: float
    prefill_seconds: float
    kv_phases: dict[str, float] = field(default_factory=dict)  # kvtransfer.SENDER_PHASES -> seconds
    kv_link_bytes: int = 0  # TransferResult.link_bytes: bytes over phase "link" (0 from older workers)
    kv_precision: str = "full"  # the KV's precision on the wire ("full" | "fp8")
    kv_bytes_saved: int = 0  # full-precision bytes minus kv_bytes (FP8 on the wire)


class WorkerClient:
    """One channel to one worker. Create and use it inside the event loop that runs the router."""

    def __init__(
        self, worker_id: str, address: str, *, rpc_timeout_s: float = 5.0,
        options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS, cluster_token: str | None = None,
    ) -> None:
        """`cluster_token`: sent with every call (pdserve.proto.auth)."""
        if rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be > 0, got {rpc_timeout_s!r}")
        self.worker_id = worker_id
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self._channel = grpc.aio.insecure_channel(address, options=list(options))
        self._stub = pb_grpc.WorkerStub(self._channel)
        self._calls: dict[Any, str] = {}  # live call -> worker-side request id
        self._cancelled: dict[Any, str] = {}  # call -> why we cancelled it
        self._metadata = call_metadata(cluster_token)

    # ---------------------------------------------------------------- unary calls

    async def reserve(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, deadline_s: float,
        *, timeout_s: float | None = None,
    ) -> Reservation:
        msg = pb.ReserveRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params_to_proto(params),
            deadline_s=deadline_s,
        )
        r = await self._unary("Reserve", self._stub.Reserve, msg, request_id, timeout_s)
        return Reservation(r.kv_address, r.transfer_id, tuple(r.block_ids), r.wire_version, r.layout)

    async def prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, reservation: Reservation,
        deadline_s: float, *, timeout_s: float | None = None, kv_precision: str = "full",
    ) -> PrefillResult:
        """`kv_precision`: the KV's precision on the wire, "full" or "fp8" (quantized by P,
        dequantized by D on landing)."""
        msg = pb.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params_to_proto(params),
            kv_address=reservation.kv_address, transfer_id=reservation.transfer_id,
            dst_block_ids=reservation.block_ids, wire_version=reservation.wire_version, layout=reservation.layout,
            deadline_s=deadline_s, kv_precision=kv_precision,
        )
        r = await self._unary("Prefill", self._stub.Prefill, msg, request_id, timeout_s)
        try:
            first = chunk_to_output(r.first)
        except ValueError as exc:
            raise self._failed(f"worker {self.worker_id} sent a bad first chunk: {exc}") from None
        return PrefillResult(first, r.kv_bytes, r.kv_seconds, r.queue_seconds, r.prefill_seconds, dict(r.kv_phases),
                             r.kv_link_bytes, r.kv_precision or "full", r.kv_bytes_saved)

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> bool:
        r = await self._unary("Abort", self._stub.Abort, pb.AbortRequest(request_id=request_id), request_id, timeout_s)
        return r.found

    async def stats(self, *, timeout_s: float | None = None) -> pb.StatsResponse:
        return await self._unary("Stats", self._stub.Stats, pb.StatsRequest(), "", timeout_s)

    async def health(self, *, timeout_s: float | None = None) -> pb.HealthResponse:
        return await self._unary("Health", self._stub.Health, pb.HealthRequest(), "", timeout_s)

    # ---------------------------------------------------------------- streams

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
        resumed_token_ids: Sequence[int] = (),
    ) -> AsyncIterator[RequestOutput]:
        """The whole request on this worker; with `resumed_token_ids`, only the tokens after them."""
        msg = pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params_to_proto(params),
            resumed_token_ids=resumed_token_ids,
        )
        return self._stream("Generate", self._open("Generate", self._stub.Generate, msg, None), request_id)

    def decode(self, request_id: str, first: RequestOutput) -> AsyncIterator[RequestOutput]:
        """The tokens after `first` (which the worker does not repeat), once the KV has landed."""
        msg = pb.DecodeRequest(request_id=request_id, first=output_to_chunk(first))
        return self._stream("Decode", self._open("Decode", self._stub.Decode, msg, None), request_id)

    # ---------------------------------------------------------------- lifecycle

    @property
    def num_active_calls(self) -> int:
        return len(self._calls)

    def cancel_calls(self, reason: str, request_id: str | None = None) -> int:
        """Cancels the live calls (of `request_id` only, when given); their readers raise WorkerFailed(reason)."""
        count = 0
        for call, rid in list(self._calls.items()):
            if request_id is None or rid == request_id:
                self._cancelled[call] = reason
                count += call.cancel()
        return count

    async def close(self) -> None:
        self.cancel_calls(f"the connection to worker {self.worker_id} was closed")
        await self._channel.close(grace=None)

    # ---------------------------------------------------------------- internals

    async def _unary(self, op: str, method: Any, msg: Any, request_id: str, timeout_s: float | None) -> Any:
        timeout = self.rpc_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        call = self._open(op, method, msg, timeout)
        self._calls[call] = request_id
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise self._error(op, exc, time.monotonic() - start, timeout) from None
        except asyncio.CancelledError:
            if _task_cancelled():
                raise
            raise self._cancelled_error(call, op) from None
        finally:
            self._forget(call)

    async def _stream(self, op: str, call: Any, request_id: str) -> AsyncIterator[RequestOutput]:
        self._calls[call] = request_id
        try:
            async for chunk in call:
                try:
                    output = chunk_to_output(chunk)
                except ValueError as exc:
                    raise self._failed(f"worker {self.worker_id} sent a bad chunk: {exc}") from None
                yield output
        except grpc.aio.AioRpcError as exc:
            raise self._error(op, exc, 0.0, None) from None
        except asyncio.CancelledError:
            if _task_cancelled():
                raise
            raise self._cancelled_error(call, op) from None
        finally:
            self._forget(call)
            call.cancel()  # no-op when done; stops the worker's stream when the reader leaves early

    def _open(self, op: str, method: Any, msg: Any, timeout: float | None) -> Any:
        try:
            return method(msg, timeout=timeout, metadata=self._metadata)
        except grpc.aio.UsageError as exc:  # the channel was closed (the worker moved or left)
            raise self._failed(f"{op} on worker {self.worker_id}: {exc}") from None

    def _failed(self, message: str) -> WorkerFailed:
        return WorkerFailed(message, worker_id=self.worker_id)

    def _forget(self, call: Any) -> None:
        self._calls.pop(call, None)
        self._cancelled.pop(call, None)

    def _cancelled_error(self, call: Any, op: str) -> WorkerFailed:
        """A call cancelled under a task that is not itself cancelled: we (or the channel) cancelled it."""
        reason = self._cancelled.get(call, "the call was cancelled")
        return self._failed(f"{op} on worker {self.worker_id} was cancelled: {reason}")

    def _error(self, op: str, exc: grpc.aio.AioRpcError, elapsed: float, timeout: float | None) -> WorkerError:
        code = exc.code()
        details = exc.details() or code.name
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None and elapsed >= 0.98 * timeout:
            # our own call timeout, not a KV deadline reported by the worker
            return self._failed(f"worker {self.worker_id} did not answer {op} within {timeout:g} s")
        cls = WORKER_STATUS_ERRORS.get(code.name, WorkerFailed)
        if cls is WorkerFailed:
            message = f"worker {self.worker_id} failed {op} ({code.name}): {details}"
        else:
            message = details
        return cls(message, worker_id=self.worker_id)


def _task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
