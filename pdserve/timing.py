"""Where a request's time went: typed records, measured where the time is spent, turned into
the JSON a client sees (`usage.pdserve_timing`, one entry per choice) in one place, `to_json`.

`WorkerTiming` is a worker's own part of a Generate call's first token (from the gRPC chunk that
carries it, pdserve.proto.convert); `RequestTiming` is what the router's cluster backend
measured for a finished request (router.cluster.recorder). Seconds unless the name says
otherwise; a field left None was not measured on this request's path and is left out of the JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class WorkerTiming:
    """The worker's part of a Generate call's first token."""

    queue_s: float  # the call in to the first engine step that took the prompt
    prefill_s: float  # that step to the first token, chunks included
    handoff_s: float  # the token ready on the engine thread to its chunk handed to gRPC


def _key(json_key: str):
    return field(default=None, metadata={"json": json_key})


@dataclass(frozen=True)
class RequestTiming:
    """A finished request's timing, as the router's cluster backend measured it (of the attempt
    that produced the first token). JSON keys in brackets."""

    # both kinds of placement
    placement: str | None = _key("placement")  # "disaggregated" | "local"
    prefill_worker: str | None = _key("prefill_worker")  # worker id (disaggregated)
    decode_worker: str | None = _key("decode_worker")  # worker id
    attempts: int | None = _key("attempts")  # placements tried
    place_s: float | None = _key("place")  # arrival at the backend to the placement decision
    first_token_s: float | None = _key("first_token")  # arrival to the first token out of the workers
    # arrival to the first delta with text (later when the first tokens decode to no text yet,
    # e.g. part of a UTF-8 character, which a streaming client sees nothing of)
    first_text_s: float | None = _key("first_text")
    queue_s: float | None = _key("queue")  # the worker's queue before the step that took the prompt
    prefill_s: float | None = _key("prefill")  # that step to the first token (queue excluded)
    # disaggregated: the decode worker's reservation, the Prefill call and the KV transfer in it
    reserve_s: float | None = _key("reserve")
    prefill_rpc_s: float | None = _key("prefill_rpc")  # the whole Prefill call, as the router saw it
    kv_s: float | None = _key("kv")  # the KV transfer
    kv_wire_s: float | None = _key("kv_wire")  # its time on the wire
    kv_wait_s: float | None = _key("kv_wait")  # its time queued behind other transfers
    kv_tail_s: float | None = _key("kv_tail")  # after the last layer was staged: what prefill did not hide
    kv_bytes: int | None = _key("kv_bytes")
    kv_gbps: float | None = _key("kv_gbps")  # kv_bytes over kv_s, in Gbit/s
    # wall clock (time.time()) when the Prefill call returned: the transfer ran over
    # [kv_done_at - kv, kv_done_at]
    kv_done_at_unix_s: float | None = _key("kv_done_at")
    # paced links: the link's time on the messages it held back (those queued behind earlier
    # bytes) and their bytes; kv_link_bytes / kv_link is the rate the link delivered while it
    # was the bottleneck; None from a worker that does not report them
    kv_link_s: float | None = _key("kv_link")
    kv_link_bytes: int | None = _key("kv_link_bytes")
    # the KV's precision on the wire (full | fp8), the bytes FP8 saved (kv_bytes are the wire's) and
    # the policy's reason (Decision.kv_precision_reason; None when a switch chose)
    kv_precision: str | None = _key("kv_precision")
    kv_bytes_saved: int | None = _key("kv_bytes_saved")
    kv_precision_reason: str | None = _key("kv_precision_reason")
    first_decode_s: float | None = _key("first_decode")  # the Decode call in to its first token
    # local: the worker's hand-off of its first token (WorkerTiming.handoff_s)
    worker_handoff_s: float | None = _key("worker_handoff")

    def to_json(self) -> dict[str, float | int | str]:
        """The `usage.pdserve_timing` entry: JSON key -> value, the fields that were measured."""
        return {f.metadata["json"]: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @staticmethod
    def json_keys() -> tuple[str, ...]:
        return tuple(f.metadata["json"] for f in fields(RequestTiming))
