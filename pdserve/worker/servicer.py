"""The worker's gRPC servicer: the request plane's calls, served on the engine thread and the KV plane.

Disaggregated request, as seen by the workers (the router drives it):
1. D.Reserve: D allocates blocks for the prompt and expects a transfer into them;
2. P.Prefill: P prefills in chunks, pushes the KV to D layer by layer, returns the first token;
3. D.Decode: D waits for the KV, joins the request to its decode batch, streams the rest;
4. Abort (or a cancelled stream): what the request holds is freed, on either worker.

When too few blocks are free, Reserve waits in line (first come, first served) until other
requests free them, bounded by the caller's deadline. Prefill pushes the blocks each chunk
completed after each of its layers (kv_push), samples the first token and answers once D
acknowledged every layer; its blocks are freed on the engine thread between steps. Decode waits
for the KV up to the deadline. The freeing of an Abort runs on the engine thread even when the
call that asked for it is gone by then (the router's RPC timed out while a long step held the
engine): nothing else would free it.

Leases: nothing is held for a peer that stops answering. P holds the prompt's blocks until D
acknowledged the KV, at most the transfer's deadline (then DEADLINE_EXCEEDED, blocks freed). D's
reservation is a lease of the deadline plus `reservation_grace_s`: a reservation that no Decode
(or Abort) claimed by then is cancelled and its blocks freed -- also when this process was
stopped meanwhile (SIGSTOP) and wakes long after: its overdue timers fire first, late KV for the
dropped transfer is NACKed and never landed, and a late Decode gets NOT_FOUND.

Generate (the whole request on one worker) is served by every role: a decode worker prefills
locally, and a prefill worker stands in for a decode worker that is down. A Prefill whose KV
could not reach D fails with ABORTED (D's fault, not P's), one whose KV missed its deadline
with DEADLINE_EXCEEDED, one whose KV failed its checksum on D with DATA_LOSS (D prefills again).
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
from dataclasses import replace

import grpc

from pdserve.kvtransfer import KVTransferCorrupt, KVTransferError, KVTransferTimeout, WIRE_VERSION
from pdserve.kvtransfer.layout import WIRE_PRECISIONS
from pdserve.engine import LLMEngine
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.convert import output_to_chunk, params_from_proto
from pdserve.sampling_params import RequestOutput
from pdserve.worker.kv_push import Destination, wire_precision

class _Stream:
    """Outputs of one request, from the engine thread to an asyncio consumer.

    `next()` returns every output that arrived since the last call as one delta
    (`RequestOutput.merge`): when the consumer falls behind the engine (many streams, fast
    steps), it sends one gRPC message for several steps' tokens instead of one per token, so the
    worker's streaming cost per token falls as its load rises. An error is raised after the
    outputs before it; nothing is merged past a finished one.

    A consumer that stops reading (a slow client holds the gRPC stream back) does not make the
    queue grow by one item per step: past MERGE_AT items they are merged into one, so a
    request holds at most MERGE_AT items, whose tokens are bounded by its max_tokens."""

    MERGE_AT = 64

    __slots__ = ("loop", "_items", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        """On the loop's thread (EngineLoop.deliver_many hands a step's outputs here)."""
        items = self._items
        items.append(item)
        if len(items) > self.MERGE_AT and all(isinstance(i, RequestOutput) and not i.finished for i in items):
            merged = RequestOutput.merge(list(items))
            items.clear()
            items.append(merged)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __call__(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.put_nowait, item)

    async def next(self) -> RequestOutput:
        items = self._items
        while not items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        first = items.popleft()
        if isinstance(first, BaseException):
            raise first
        batch = [first]
        while items and not batch[-1].finished and not isinstance(items[0], BaseException):
            batch.append(items.popleft())
        return RequestOutput.merge(batch)

    def __len__(self) -> int:
        """Items waiting for the consumer."""
        return len(self._items)


class WorkerServicer(pb_grpc.WorkerServicer):
    """The calls of one worker (module docstring); `worker`: the WorkerServer it serves (worker.server),
    whose engine loop, KV plane and reservations it uses."""

    def __init__(self, worker) -> None:
        self.w = worker

    # ---- helpers ---------------------------------------------------------------------------
    async def _engine(self, fn):
        return await asyncio.wrap_future(self.w.loop.submit(fn))

    async def _engine_cleanup(self, fn):
        """`_engine` for a command that frees what a request holds: it runs even when the caller
        is cancelled while it waits for the engine thread (the router's RPC timed out during a
        long step); cancelled, `_engine` would drop the queued command and the blocks with it."""
        return await asyncio.shield(asyncio.wrap_future(self.w.loop.submit(fn)))

    async def _fail(self, context, code: grpc.StatusCode, message: str):
        await context.abort(code, message)

    @staticmethod
    def _caller_gone(context) -> bool:
        """The caller has given up on this call: cancelled, or its deadline passed. A call that
        reaches a worker late (it was stopped, SIGSTOP, while the call waited in its socket) must
        not take blocks that nobody will claim."""
        try:
            if context.cancelled():
                return True
            remaining = context.time_remaining()
        except Exception:  # a context without these (tests' stand-ins): assume the caller waits
            return False
        return remaining is not None and remaining <= 0

    def _check_role(self, side: str, rpc: str) -> str | None:
        """`side`: "send" (Prefill) or "receive" (Reserve, Decode) of a KV hand-off."""
        config = self.w.config
        if not (config.sends_kv if side == "send" else config.receives_kv):
            kind = "mixed worker without KV transfers" if config.role == "mixed" else f"{config.role} worker"
            return f"{rpc} is not served by a {kind}"
        return None

    async def _stream(self, request_id: str, start, context, offset: tuple[int, int] = (0, 0)):
        """Subscribes, runs `start(engine)` on the engine thread, yields chunks until done;
        a cancelled stream aborts the request."""
        stream = _Stream(asyncio.get_running_loop())
        self.w.loop.subscribe(request_id, stream)
        called_at = time.monotonic()
        finished = False
        try:
            try:
                first = await self._engine(start)
            except ValueError as exc:
                self.w.loop.unsubscribe(request_id)
                await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                return
            if first is not None:  # the request finished at once
                self.w.loop.unsubscribe(request_id)
                finished = True
                yield self._shift(first, offset, called_at)
                return
            while True:
                out = await stream.next()
                finished = out.finished
                yield self._shift(out, offset, called_at)
                if finished:
                    return
        except RuntimeError as exc:
            await self._fail(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            if not finished:
                self.w.loop.unsubscribe(request_id)
                self.w.loop.submit(lambda e: e.abort_request(request_id))

    @staticmethod
    def _shift(out: RequestOutput, offset: tuple[int, int], called_at: float | None = None) -> pb.TokenChunk:
        chunk = output_to_chunk(out)
        chunk.num_prompt_tokens -= offset[0]
        chunk.num_output_tokens += offset[1]
        if called_at is not None and out.first_token_times is not None:
            # where the call's time to its first token went (worker.proto, TokenChunk)
            scheduled, ready = out.first_token_times
            chunk.queue_seconds = max(0.0, scheduled - called_at)
            chunk.prefill_seconds = max(0.0, ready - max(scheduled, called_at))
            chunk.handoff_seconds = max(0.0, time.monotonic() - ready)
        return chunk

    # ---- RPCs ------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context):
        # every role generates: a prefill worker stands in for a decode worker that is down
        try:
            params = params_from_proto(request.params)
        except ValueError as exc:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        resumed = list(request.resumed_token_ids)
        prompt = list(request.prompt_token_ids) + resumed
        if resumed:
            if len(resumed) >= params.max_tokens:
                await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT,
                                 "resumed_token_ids already reach max_tokens")
                return
            params = replace(params, max_tokens=params.max_tokens - len(resumed),
                             min_tokens=max(0, params.min_tokens - len(resumed)))
        rid = request.request_id
        async for chunk in self._stream(rid, lambda e: e.add_request(rid, prompt, params, hand_off=False,
                                                                     num_generated=len(resumed)), context,
                                        offset=(len(resumed), len(resumed))):
            yield chunk

    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        if (err := self._check_role("receive", "Reserve")) is not None:
            await self._fail(context, grpc.StatusCode.FAILED_PRECONDITION, err)
        try:
            params = params_from_proto(request.params)
        except ValueError as exc:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rid = request.request_id
        if self._caller_gone(context):
            await self._fail(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"Reserve for {rid!r} arrived after its caller gave up; nothing reserved")
        prompt = list(request.prompt_token_ids)
        # 128 random bits: the transfer's wire key (a hash of the id) is known only to the prefill
        # worker this Reserve is handed to, so KV from any other connection is dropped unlanded
        transfer_id = f"{rid}/{secrets.token_hex(16)}"
        deadline = request.deadline_s if request.deadline_s > 0 else self.w.default_deadline_s

        loop = asyncio.get_running_loop()
        granted: asyncio.Future = loop.create_future()

        def resolve(result: list[int] | BaseException) -> None:  # on the asyncio loop
            if granted.done():
                return
            if isinstance(result, BaseException):
                granted.set_exception(result)
            else:
                granted.set_result(result)

        def on_granted(blocks: list[int]) -> None:  # on the engine thread, once the blocks are ours
            try:
                self.w.receiver.expect(transfer_id, blocks, self.w.engine.model_config.num_layers, deadline)
            except Exception as exc:
                loop.call_soon_threadsafe(resolve, exc)
                raise  # the engine drops the reservation
            loop.call_soon_threadsafe(resolve, blocks)

        # A reservation that does not fit now waits in the engine's line for blocks (KV that
        # other requests free), bounded by the caller's deadline; a cancelled call leaves it.
        try:
            await self._engine(lambda e: e.reserve(rid, prompt, params, on_granted=on_granted))
            blocks = await granted
        except ValueError as exc:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except BaseException:  # cancelled, or the expectation failed: on the engine thread, after any grant
            self.w.loop.submit(lambda e: (self.w.receiver.cancel(transfer_id), e.abort_request(rid)))
            raise
        if self._caller_gone(context):  # granted after the caller left: nobody will claim these blocks
            self.w.loop.submit(lambda e: (self.w.receiver.cancel(transfer_id), e.abort_request(rid)))
            await self._fail(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"Reserve for {rid!r} was granted after its caller gave up; its blocks are freed")
        self.w.transfers[rid] = transfer_id
        self.w.lease_reservation(rid, transfer_id, deadline + self.w.reservation_grace_s)
        return pb.ReserveResponse(kv_address=self.w.kv_address, transfer_id=transfer_id, block_ids=blocks,
                                  wire_version=WIRE_VERSION, layout=self.w.layout_fingerprint)

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        if (err := self._check_role("send", "Prefill")) is not None:
            await self._fail(context, grpc.StatusCode.FAILED_PRECONDITION, err)
        if request.wire_version != WIRE_VERSION or request.layout != self.w.layout_fingerprint:
            await self._fail(context, grpc.StatusCode.FAILED_PRECONDITION,
                             f"KV wire/layout mismatch: decode has v{request.wire_version} {request.layout!r}, "
                             f"prefill has v{WIRE_VERSION} {self.w.layout_fingerprint!r}")
        try:
            params = params_from_proto(request.params)
        except ValueError as exc:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        precision = request.kv_precision or "full"
        if precision not in WIRE_PRECISIONS:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT,
                             f"kv_precision must be one of {', '.join(WIRE_PRECISIONS)}, got {precision!r}")
        dest = Destination(request.kv_address, request.transfer_id, list(request.dst_block_ids), precision=precision)
        expected_blocks = -(-len(prompt) // self.w.block_size)
        if len(dest.dst_block_ids) != expected_blocks:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT,
                             f"{len(dest.dst_block_ids)} destination blocks for a {len(prompt)}-token prompt "
                             f"(expected {expected_blocks})")
        deadline = request.deadline_s if request.deadline_s > 0 else self.w.default_deadline_s
        t0 = time.monotonic()

        def start(engine: LLMEngine):
            self.w.pusher.add(rid, dest)
            try:
                engine.add_request(rid, prompt, params, hand_off=True)
            except Exception:
                self.w.pusher.remove(rid)
                raise
            return None

        stream = _Stream(asyncio.get_running_loop())
        self.w.loop.subscribe(rid, stream)
        released = False

        def free(e: LLMEngine) -> None:  # on the engine thread
            self.w.pusher.remove(rid)
            e.release(rid)
            e.abort_request(rid)

        async def release():
            nonlocal released
            if not released:
                released = True
                self.w.loop.unsubscribe(rid)
                await self._engine_cleanup(free)

        try:
            try:
                await self._engine(start)
            except ValueError as exc:
                await release()
                await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            first = await stream.next()
            t_first = time.monotonic()
            if dest.error is not None:
                await release()
                await self._fail(context, grpc.StatusCode.ABORTED, f"KV push to the decode worker failed: {dest.error}")
            try:
                result = await asyncio.to_thread(self.w.sender.finish, dest.transfer_id, deadline)
            except KVTransferTimeout as exc:
                await release()
                await self._fail(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"KV transfer: {exc}")
            except KVTransferCorrupt as exc:  # the decode worker did not use it: prefill again there
                await release()
                await self._fail(context, grpc.StatusCode.DATA_LOSS, f"KV transfer: {exc}")
            except KVTransferError as exc:
                await release()
                await self._fail(context, grpc.StatusCode.ABORTED, f"KV transfer to the decode worker failed: {exc}")
            # the request's blocks are freed on the engine thread between steps; the answer does
            # not wait for that: behind a step running now (another prompt's prefill) it waited up
            # to that step's time, which every disaggregated TTFT paid on a busy prefill worker
            # (docs/results.md, "Figures behind the code's choices"). Commands run in order, so the
            # next request's own still finds them freed first.
            released = True
            self.w.loop.unsubscribe(rid)
            self.w.loop.submit(free)
            self.w.kv_bytes += result.num_bytes
            self.w.kv_seconds += result.seconds
            chunk = output_to_chunk(first)
            if first.finish_reason == "prefilled":
                chunk.finished = False
                chunk.finish_reason = ""
            # queue: Prefill call in -> its first chunk's first layer done (waiting for the scheduler)
            queue_s = max(0.0, dest.started_at - t0) if dest.started_at else 0.0
            wire, saved = wire_precision(self.w.kv_layout, precision, len(dest.dst_block_ids), result.num_bytes)
            return pb.PrefillResponse(first=chunk, kv_bytes=result.num_bytes, kv_seconds=result.seconds,
                                      queue_seconds=queue_s, prefill_seconds=t_first - t0, kv_phases=result.phases,
                                      kv_link_bytes=result.link_bytes, kv_precision=wire, kv_bytes_saved=saved)
        except RuntimeError as exc:
            await release()
            await self._fail(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            if not released:  # cancelled by the caller
                self.w.loop.unsubscribe(rid)
                self.w.loop.submit(free)

    async def Decode(self, request: pb.DecodeRequest, context):
        if (err := self._check_role("receive", "Decode")) is not None:
            await self._fail(context, grpc.StatusCode.FAILED_PRECONDITION, err)
            return
        rid = request.request_id
        transfer_id = self.w.transfers.pop(rid, None)
        if transfer_id is None or not len(request.first.token_ids):
            await self._fail(context, grpc.StatusCode.NOT_FOUND, f"no reservation for request {rid!r}")
            return
        try:
            result = await asyncio.to_thread(self.w.receiver.wait, transfer_id, self.w.default_deadline_s)
        except (KVTransferTimeout, KVTransferError) as exc:
            self.w.receiver.cancel(transfer_id)
            await self._engine_cleanup(lambda e: e.abort_request(rid))
            code = (grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(exc, KVTransferTimeout)
                    else grpc.StatusCode.DATA_LOSS if isinstance(exc, KVTransferCorrupt)
                    else grpc.StatusCode.UNAVAILABLE)
            await self._fail(context, code, f"KV transfer: {exc}")
            return
        except BaseException:  # the caller left while the KV was on its way: nothing else frees the claimed reservation
            self.w.receiver.cancel(transfer_id)
            self.w.loop.submit(lambda e: e.abort_request(rid))
            raise
        self.w.kv_bytes += result.num_bytes
        self.w.kv_seconds += result.seconds
        first_token = request.first.token_ids[-1]
        async for chunk in self._stream(rid, lambda e: e.commit(rid, first_token), context):
            yield chunk

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        rid = request.request_id
        transfer_id = self.w.transfers.pop(rid, None)
        if transfer_id is not None and self.w.receiver is not None:
            self.w.receiver.cancel(transfer_id)

        def abort(engine: LLMEngine) -> bool:
            if self.w.pusher is not None:
                self.w.pusher.remove(rid)
            return engine.abort_request(rid)

        found = await self._engine_cleanup(abort)
        self.w.loop.end_aborted(rid)
        return pb.AbortResponse(found=found)

    async def Stats(self, request, context) -> pb.StatsResponse:
        return self.w.stats()

    async def Health(self, request, context) -> pb.HealthResponse:
        healthy = self.w.loop.alive
        return pb.HealthResponse(healthy=healthy, worker_id=self.w.config.worker_id, role=self.w.config.role,
                                 detail="" if healthy else "engine loop stopped")
