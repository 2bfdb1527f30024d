"""Prefill side of the KV hand-off: which blocks to push after each layer of each step.

A request with a destination pushes every block of its prompt exactly once per layer: a
block goes as soon as a chunk completes it (or, for the trailing partial block, when the
prompt's last chunk is computed). A transfer in FP8 sends its first `FP8_FULL_HEAD_BLOCKS`
blocks at full precision all the same (kvtransfer.layout: the attention sink). The engine's
layer hook calls `on_layer`, so layer L of a chunk is on the wire while layer L+1 computes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.kvtransfer import KVLayout, KVSender
from pdserve.kvtransfer.layout import FP8_FULL_HEAD_BLOCKS
from pdserve.scheduler import ScheduledBatch


@dataclass
class Destination:
    address: str
    transfer_id: str
    dst_block_ids: list[int]
    num_sent_blocks: int = 0  # blocks [0, n) are pushed for every layer
    error: BaseException | None = None  # a push failed; the prefill reports it
    started_at: float = 0.0  # time.monotonic() when the first layer of its first chunk was done (0: not yet)
    precision: str = "full"  # the KV's precision on the wire (kvtransfer.layout.WIRE_PRECISIONS), per request


@dataclass
class _Push:
    dest: Destination
    src: list[int]
    dst: list[int]
    end_block: int
    precision: str = "full"


@dataclass
class KVPusher:
    sender: KVSender
    block_size: int
    num_layers: int
    destinations: dict[str, Destination] = field(default_factory=dict)
    _batch_id: int = -1
    _pushes: list[_Push] = field(default_factory=list)

    def add(self, request_id: str, dest: Destination) -> None:
        self.destinations[request_id] = dest

    def remove(self, request_id: str) -> Destination | None:
        return self.destinations.pop(request_id, None)

    def on_layer(self, layer: int, batch: ScheduledBatch) -> None:
        if not self.destinations:
            return
        if layer == 0 or id(batch) != self._batch_id:
            self._batch_id = id(batch)
            self._pushes = self._plan(batch)
        for push in self._pushes:
            if push.dest.error is not None:
                continue
            try:
                self.sender.send_layer(push.dest.address, push.dest.transfer_id, layer, push.src, push.dst,
                                       precision=push.precision)
            except Exception as exc:  # the request fails, the step goes on
                push.dest.error = exc
        if layer == self.num_layers - 1:
            for push in self._pushes:
                push.dest.num_sent_blocks = push.end_block
            self._pushes = []

    def _plan(self, batch: ScheduledBatch) -> list[_Push]:
        pushes = []
        bs = self.block_size
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            dest = self.destinations.get(seq.request_id)
            if dest is None:
                continue
            if not dest.started_at:
                dest.started_at = time.monotonic()
            computed = seq.num_computed_tokens + num_new  # after this step
            prompt_done = computed >= seq.num_prompt_tokens
            end_block = -(-seq.num_prompt_tokens // bs) if prompt_done else computed // bs
            end_block = min(end_block, len(dest.dst_block_ids))
            if end_block <= dest.num_sent_blocks:
                continue
            src = [seq.block_ids[i] for i in range(dest.num_sent_blocks, end_block)]
            dst = dest.dst_block_ids[dest.num_sent_blocks:end_block]
            head = min(FP8_FULL_HEAD_BLOCKS, end_block) - dest.num_sent_blocks if dest.precision == "fp8" else 0
            if head > 0:  # the attention sink's block at full precision
                pushes.append(_Push(dest, src[:head], dst[:head], end_block, "full"))
                src, dst = src[head:], dst[head:]
            if src:
                pushes.append(_Push(dest, src, dst, end_block, dest.precision))
        return pushes


def wire_precision(layout: KVLayout, precision: str, num_blocks: int, wire_bytes: int) -> tuple[str, int]:
    """(the precision a transfer's bytes had on the wire, the bytes FP8 saved against full
    precision) for a transfer of ``num_blocks`` blocks asked for at ``precision`` that moved
    ``wire_bytes``. An FP8 pool's bytes are FP8 whatever was asked, and save nothing; a transfer
    no longer than its full-precision head (FP8_FULL_HEAD_BLOCKS) went at full precision, and so
    did one that moved no fewer bytes than full precision (a backend without FP8 on its wire)."""
    if layout.torch_dtype.itemsize == 1:
        return "fp8", 0
    if precision != "fp8" or not layout.fp8_wire or num_blocks <= FP8_FULL_HEAD_BLOCKS:
        return "full", 0
    saved = layout.num_layers * layout.layer_message_bytes(num_blocks) - wire_bytes
    return ("fp8", saved) if saved > 0 else ("full", 0)
