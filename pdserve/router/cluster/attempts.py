"""One attempt of a request: its placement decision run on the workers it names.

- disaggregated: D.Reserve -> P.Prefill (P pushes KV to D and returns the first token, which is
  yielded at once) -> D.Decode streams the rest. A first token that already finishes the
  request frees D's reservation with D.Abort instead;
- local or colocated: D.Generate (the whole request on one worker; `resumed_token_ids` = the
  tokens the client already has, after a migration).

A worker that ends the request with "abort" on its own failed it (WorkerFailed); a KV push that
fails (Prefill answers ABORTED) is the decode worker's failure. An attempt that ends unfinished
aborts its parts on the workers (unless the client aborted: the backend did). The recovery that
follows a failure is the backend's (router.cluster.backend).

Network view (router.cluster.network): each Prefill is a KV flow on the link from P's node to D's
node (router.placement.topology); the `LinkMonitor` (router.placement.congestion) counts it while it runs and takes
the throughput it reports as a sample (a Prefill whose KV missed its deadline: an upper bound, its
bytes over the deadline, which lowers the link's estimate at once); KV bytes per token are learned
from those reports.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from pdserve.router.cluster.flight import Aborter, Flight
from pdserve.router.cluster.network import NetworkTracker
from pdserve.router.cluster.recorder import RequestRecorder, disaggregated_timing
from pdserve.router.cluster.worker_client import PrefillResult
from pdserve.router.cluster.worker_pool import WorkerPool
from pdserve.router.errors import KVPushFailed, KVTransferCorrupted, KVTransferDeadline, WorkerFailed
from pdserve.router.placement.base import Decision
from pdserve.sampling_params import RequestOutput, SamplingParams


class Attempts:
    """Runs attempts on the workers of `pool` (module docstring). `precision_of(decision)`: the KV's
    precision on the wire for a disaggregated decision. Reserve and Prefill may wait in line
    `queue_timeout_s`; D waits queue_timeout_s + kv_deadline_s for the KV."""

    def __init__(self, pool: WorkerPool, network: NetworkTracker, recorder: RequestRecorder, aborter: Aborter,
                 precision_of: Callable[[Decision], str], *, kv_deadline_s: float, queue_timeout_s: float,
                 rpc_timeout_s: float) -> None:
        self.pool = pool
        self.network = network
        self.recorder = recorder
        self.aborter = aborter
        self.precision_of = precision_of
        self.kv_deadline_s = kv_deadline_s
        self.queue_timeout_s = queue_timeout_s
        self.rpc_timeout_s = rpc_timeout_s

    async def disaggregated(
        self, flight: Flight, decision: Decision, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        assert decision.prefill is not None
        prefill, decode = self.pool.workers[decision.prefill], self.pool.workers[decision.decode]
        wire_id = flight.next_wire_id()
        finished = False
        flight.parts = {decode.worker_id: (decode.client, wire_id)}
        n = len(prompt)
        # P's queue and the P->D flow count from the decision on, like D's: counted only
        # after D's Reserve answered, requests placed meanwhile saw an idle P and link.
        decode.num_inflight += 1
        decode.num_inflight_tokens += n
        prefill.num_inflight += 1
        prefill.num_inflight_tokens += n
        flow = self.network.start_flow(prefill, decode, n)
        try:
            result: PrefillResult | None = None
            missed_deadline_s: float | None = None  # the KV missed it: the link is slower than it was priced
            try:
                started = time.monotonic()
                # D's Reserve waits in line for blocks and P's Prefill in P's queue: the queue
                # bound (generate) limits both, so D also waits that long for the KV
                queue_s = self.queue_timeout_s
                reservation = await decode.client.reserve(wire_id, prompt, params, queue_s + self.kv_deadline_s,
                                                          timeout_s=queue_s + self.rpc_timeout_s)
                reserved = time.monotonic()
                flight.parts[prefill.worker_id] = (prefill.client, wire_id)
                try:
                    result = await prefill.client.prefill(
                        wire_id, prompt, params, reservation, self.kv_deadline_s,
                        timeout_s=queue_s + self.kv_deadline_s + self.rpc_timeout_s,
                        kv_precision=self.precision_of(decision),
                    )
                except KVPushFailed as exc:  # D did not take the KV: D failed, not P
                    raise WorkerFailed(f"{exc.message} (reported by {prefill.worker_id})",
                                       worker_id=decode.worker_id) from exc
                except KVTransferDeadline as exc:
                    if not isinstance(exc, KVTransferCorrupted):  # late, not damaged
                        missed_deadline_s = self.kv_deadline_s
                    raise
                self.recorder.record_first_token_phases(reserved - started, time.monotonic() - reserved, result)
                flight.time(**disaggregated_timing(decision, reserved - started, time.monotonic() - reserved, result))
            finally:
                prefill.num_inflight -= 1
                prefill.num_inflight_tokens -= n
                self.network.finish_flow(flow, result, n, missed_deadline_s)
            self.recorder.record_transfer(flow.key, result)
            first = result.first
            if flight.worker_aborted(first):
                raise WorkerFailed(f"worker {prefill.worker_id} aborted the request", worker_id=prefill.worker_id)
            if first.finished:
                finished = True
                self.aborter.spawn(self.aborter.abort_parts([(decode.client, wire_id)]))  # frees D's reservation
                yield first
                return
            yield first
            decode_started = time.monotonic()
            async for output in decode.client.decode(wire_id, first):
                if flight.timing.first_decode_s is None and output.new_token_ids:
                    flight.time(first_decode_s=time.monotonic() - decode_started)
                if flight.worker_aborted(output):
                    if output.new_token_ids:  # keep what it produced; the retry resumes after it
                        yield replace(output, finished=False, finish_reason=None)
                    raise WorkerFailed(f"worker {decode.worker_id} aborted the request", worker_id=decode.worker_id)
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            decode.num_inflight -= 1
            decode.num_inflight_tokens -= n
            parts, flight.parts = list(flight.parts.values()), {}
            if not finished and not flight.aborted:
                await self.aborter.abort_parts(parts)

    async def local(
        self, flight: Flight, worker_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        worker = self.pool.workers[worker_id]
        wire_id = flight.next_wire_id()
        finished = False
        flight.parts = {worker_id: (worker.client, wire_id)}
        n = len(prompt) + len(flight.sent_token_ids)
        if not flight.sent_token_ids:
            flight.time(placement="local", decode_worker=worker_id)
        worker.num_inflight += 1
        worker.num_inflight_tokens += n
        try:
            async for output in worker.client.generate(wire_id, prompt, params, flight.sent_token_ids):
                if output.worker_timing is not None:  # the worker's part of the first token
                    if flight.timing.first_token_s is None and output.new_token_ids:
                        w = output.worker_timing
                        flight.time(queue_s=w.queue_s, prefill_s=w.prefill_s, worker_handoff_s=w.handoff_s)
                    output.worker_timing = None
                if flight.worker_aborted(output):
                    if output.new_token_ids:
                        yield replace(output, finished=False, finish_reason=None)
                    raise WorkerFailed(f"worker {worker_id} aborted the request", worker_id=worker_id)
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            worker.num_inflight -= 1
            worker.num_inflight_tokens -= n
            parts, flight.parts = list(flight.parts.values()), {}
            if not finished and not flight.aborted:
                await self.aborter.abort_parts(parts)
