"""The UCX backend's sender (prefill side): ``UcxSender``, what the engine's threads call.

``send_layer`` gathers K then V of the blocks of a layer into a staging buffer; consecutive layers
of one transfer's chunk are coalesced into one message up to ``coalesce_bytes`` (default 64 MiB
for CUDA pools, where a message costs far more in fixed overhead than in bytes; 0, one layer per
message, for host pools, where the link is slow next to compute and each layer should leave as
soon as it is computed); a paced link coalesces at most what it moves in a couple of
milliseconds (``_open_group``). A group is sent when it is full or at the chunk's last layer, so
the layers of a chunk overlap the next chunk's compute. On CUDA a waiter thread hands each
message to the event loop once its gather is done, in order; the loop side (connection,
handshake, posting, replies) is ``SenderLoop`` (``pdserve.kvtransfer.ucx.sender_loop``).

Pull path (same host, CUDA pools that are one allocation, ``pull=True``, no pacer on the link):
HELLO offers the pools' descriptor (``pdserve.kvtransfer.ipc``); once the receiver has mapped
them a message is the control message alone (up to 256 MiB of KV per message, after the layers
are computed) and the receiver copies the blocks itself. The sender keeps its blocks until the
ACK (the prefill worker releases them after ``finish``). The link's first transfer, sent before
the handshake ends, takes the staged path.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pdserve.kernels.kv_codec import pack_blocks
from pdserve.kvtransfer import trace
from pdserve.kvtransfer.base import KVCaches, KVSender, TransferResult, wire_fp8
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.faults import FaultInjector, FaultSpec
from pdserve.kvtransfer.ipc import export_pools
from pdserve.kvtransfer.layout import (
    CHECKSUM,
    CHECKSUM_BYTES,
    FP8_WIRE,
    PULL,
    KVLayout,
    MsgKind,
    WireHeader,
    payload_checksum,
    transfer_key,
)
from pdserve.kvtransfer.ledger import SendLedger
from pdserve.kvtransfer.pacing import LinkHolds, LinkPacer
from pdserve.kvtransfer.staging import (
    HostBuffers, block_index, gather_layer, gather_layers, ready_prefix, stacked_pools,
)
from pdserve.kvtransfer.ucx.common import _LIVE, _check_token
from pdserve.kvtransfer.ucx.sender_loop import SenderLoop, _Link, _Message
from pdserve.kvtransfer.ucx_runtime import UcxRuntime, parse_address

_PULL_BYTES = 256 << 20  # most KV bytes per pulled message (UcxSender._open_group)


@dataclass
class _Group:
    """Consecutive layers of one transfer's chunk, gathered into one staging buffer."""

    address: str
    transfer_id: str
    ids: tuple  # (src ids, dst ids)
    dst_bytes: bytes
    num_blocks: int
    first_layer: int
    capacity: int  # layers
    buffer: torch.Tensor | None  # flat uint8, capacity * layer bytes; None when pulled
    src: torch.Tensor  # the gather index on the pools' device
    count: int = 0
    src_bytes: bytes = b""  # int32 source ids, when pulled
    fp8: bool = False  # quantized to FP8 at flush (layout FP8_WIRE); never pulled


class UcxSender(SenderLoop, KVSender):
    """Options: ``pacer`` (a LinkPacer keyed by address), ``connect_timeout``,
    ``max_inflight`` (messages posted and not yet completed, per connection),
    ``coalesce_bytes`` (most payload bytes per message; None: 64 MiB for CUDA pools, 0 --
    one layer per message -- for host pools), ``pull`` (offer the pools to receivers on this
    host, who then copy the blocks straight from them: no staging, no payload message; a link
    with a pacer bucket always sends the bytes), ``model`` (the model's name, checked at
    handshake against the receiver's), ``checksum`` (a CRC-32 of every payload, checked by the
    receiver; None: on for host pools), ``faults`` (``pdserve.kvtransfer.faults``: drop, duplicate,
    reorder or corrupt messages with given probabilities; tests and the fault matrix only),
    ``token`` (the cluster token: proved to each receiver, which must prove it back; None: a
    cluster without one, whose receivers must not ask for it)."""

    _INDEX_CACHE = 16  # block lists kept as device index tensors and wire bytes (one per chunk in flight)

    def __init__(
        self,
        kv_caches: KVCaches,
        pacer: LinkPacer | None = None,
        connect_timeout: float = 5.0,
        max_inflight: int = 16,
        coalesce_bytes: int | None = None,
        pull: bool = True,
        model: str = "",
        checksum: bool | None = None,
        faults: FaultSpec | str | None = None,
        token: str | None = None,
    ):
        _check_token(token)
        self._model = model
        self._token = token
        # a CRC-32 of each payload (host pools; what it costs: docs/faults.md; CUDA pools are not
        # checked: the payload never passes through the host)
        self._checksum = (not kv_caches[0][0].is_cuda) if checksum is None else bool(checksum)
        self._faults = FaultInjector(faults) if faults else None
        if not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        if coalesce_bytes is None:
            coalesce_bytes = 64 << 20 if kv_caches and kv_caches[0][0].is_cuda else 0
        if not isinstance(coalesce_bytes, int) or isinstance(coalesce_bytes, bool) or coalesce_bytes < 0:
            raise ValueError(f"coalesce_bytes must be an int >= 0, got {coalesce_bytes!r}")
        self._coalesce_bytes = coalesce_bytes
        self.layout = KVLayout.from_caches(kv_caches)
        self._caches = kv_caches
        self._pacer = pacer
        self._connect_timeout = connect_timeout
        self._max_inflight = max_inflight
        self._ledger = SendLedger()
        self._links: dict[str, _Link] = {}
        self._pacing_delay = 0.0
        self._holds = LinkHolds()  # which posts the paced links held back (phase "link")
        self._closed = False
        self._close_lock = threading.Lock()
        self._waiter: queue.SimpleQueue | None = None
        self._index_cache: collections.OrderedDict[tuple, tuple[torch.Tensor, bytes, tuple]] = collections.OrderedDict()
        self._host_buffers = HostBuffers() if not kv_caches[0][0].is_cuda else None
        self._stacked = stacked_pools(kv_caches)  # then a message is gathered in one op, at flush
        self._descriptor = export_pools(self._stacked) if pull else b""  # offered in HELLO
        self._buffers_lock = threading.Lock()
        # open groups by (transfer id, FP8): an FP8 transfer's head blocks go at full precision
        # (pdserve.worker.kv_push), in a stream of their own, layer after layer, beside the rest
        self._groups: dict[tuple[str, bool], _Group] = {}
        self._groups_lock = threading.Lock()
        self._rt = UcxRuntime.acquire(host_memory=not kv_caches[0][0].is_cuda)
        _LIVE.add(self)

    def _indices(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                 pool: torch.Tensor) -> tuple[torch.Tensor, bytes, tuple]:
        """The gather index of the source blocks on the pools' device and the wire bytes of the
        destination ids. Every layer of a chunk sends the same blocks, so both are built (and
        checked) once per chunk: building the index on CUDA from a Python list is a
        synchronous copy that would stall the engine's stream at every layer."""
        ids = (tuple(src_block_ids), tuple(dst_block_ids))
        cached = self._index_cache.get(ids)
        if cached is not None:
            self._index_cache.move_to_end(ids)
            return cached
        if len(ids[0]) != len(ids[1]):
            raise ValueError(f"{len(ids[0])} source blocks but {len(ids[1])} destination blocks")
        src = block_index(ids[0], pool.shape[0], "src_block_ids", torch.device("cpu"))
        dst = block_index(ids[1], None, "dst_block_ids", torch.device("cpu"))
        if pool.is_cuda:
            src = src.pin_memory().to(pool.device, non_blocking=True)
        cached = self._index_cache[ids] = (src, dst.numpy().astype("<i4").tobytes(), ids)
        if len(self._index_cache) > self._INDEX_CACHE:
            self._index_cache.popitem(last=False)
        return cached

    def send_layer(self, address, transfer_id, layer, src_block_ids, dst_block_ids, precision="full") -> None:
        fp8 = wire_fp8(self.layout, precision)
        if self._closed:
            raise KVTransferError("sender is closed")
        if not isinstance(layer, int) or not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer!r} outside [0, {self.layout.num_layers})")
        if trace.ENABLED and layer == 0:
            trace.mark("s.layer0", transfer_key(transfer_id))
        pool = self._caches[layer][0]
        src, dst_bytes, ids = self._indices(src_block_ids, dst_block_ids, pool)
        key = (transfer_id, fp8)
        with self._groups_lock:
            group = self._groups.get(key)
            if group is not None and (group.address != address or group.ids != ids
                                      or layer != group.first_layer + group.count):
                self._flush(self._groups.pop(key))
                group = None
            if group is None:
                parse_address(address)
                group = self._open_group(address, transfer_id, layer, ids, dst_bytes, src, fp8)
            if group.buffer is not None and self._stacked is None:
                layer_bytes = self.layout.layer_message_bytes(group.num_blocks)
                gather_layer(self._caches, layer, src,
                             group.buffer[group.count * layer_bytes:(group.count + 1) * layer_bytes])
            group.count += 1
            if group.count == group.capacity or layer == self.layout.num_layers - 1:
                self._flush(self._groups.pop(key))

    def _open_group(self, address: str, transfer_id: str, layer: int, ids: tuple, dst_bytes: bytes,
                    src: torch.Tensor, fp8: bool = False) -> _Group:
        num_blocks = len(ids[0])
        layer_bytes = self.layout.layer_message_bytes(num_blocks)
        limit = self._coalesce_bytes
        bucket = self._pacer.bucket_for(address) if self._pacer is not None else None
        if bucket is not None:
            limit = min(limit, int(bucket.bytes_per_second * 2e-3))
        capacity = max(1, min(self.layout.num_layers - layer, limit // layer_bytes))
        link = self._links.get(address)
        if link is not None and link.pull and bucket is None and not fp8:  # the receiver reads the pools
            # and no buffer bound: a message costs a chain of thread hand-offs on both sides, far
            # more than the copy of a layer (docs/results.md), so a pulled message carries up to _PULL_BYTES
            capacity = max(1, min(self.layout.num_layers - layer, max(limit, _PULL_BYTES) // layer_bytes))
            group = _Group(address, transfer_id, ids, dst_bytes, num_blocks, layer, capacity, None, src,
                           src_bytes=np.asarray(ids[0], dtype="<i4").tobytes())
            self._groups[(transfer_id, fp8)] = group
            return group
        if self._host_buffers is not None:
            with self._buffers_lock:
                buffer = self._host_buffers.take(capacity * layer_bytes)
        else:
            buffer = torch.empty(capacity * layer_bytes, dtype=torch.uint8, device=self._caches[0][0].device)
        group = _Group(address, transfer_id, ids, dst_bytes, num_blocks, layer, capacity, buffer, src, fp8=fp8)
        self._groups[(transfer_id, fp8)] = group
        return group

    def _flush(self, group: _Group) -> None:
        """Sends an open group as one message (called with the groups lock held)."""
        if self._caches[0][0].is_cuda:  # any thread may flush (finish() too): gather on the pools' GPU
            with torch.cuda.device(self._caches[0][0].device):
                return self._flush_on_device(group)
        return self._flush_on_device(group)

    def _flush_on_device(self, group: _Group) -> None:
        nbytes = group.count * self.layout.layer_message_bytes(group.num_blocks)
        device = self._caches[0][0].device
        payload = None
        if group.buffer is not None:
            payload = group.buffer[:nbytes]
            if self._stacked is not None:  # the group's layers are computed: gather them all at once
                gather_layers(self._stacked, group.first_layer, group.count, group.src, payload)
            if group.fp8:  # the gathered blocks, quantized: what goes on the wire
                staged = payload.view(self.layout.torch_dtype).view(group.count, 2, group.num_blocks,
                                                                     *self.layout.block_shape)
                payload = pack_blocks(staged).view(-1)
                nbytes = payload.numel()
        ready = None
        if device.type == "cuda":  # the gather or, pulled, the layers' compute
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        key = self._ledger.on_enqueue(group.transfer_id, group.address, nbytes)
        trace.mark("s.flush", key, group.first_layer)
        status, crc = (PULL, b"") if payload is None else (FP8_WIRE if group.fp8 else 0, b"")
        if payload is not None and self._checksum and device.type == "cpu":
            status |= CHECKSUM
            crc = payload_checksum(payload).to_bytes(CHECKSUM_BYTES, "little")
        header = WireHeader(MsgKind.LAYER, key, group.first_layer, group.num_blocks, nbytes,
                            self.layout.fingerprint, layers=group.count, status=status)
        control = np.frombuffer(header.pack() + group.dst_bytes + group.src_bytes + crc, dtype=np.uint8)
        msg = _Message(key, control, payload, nbytes, ready, buffer=group.buffer)
        if ready is None:
            self._ledger.on_staged(key)
            msg.ready_at = self._pacer.now() if self._pacer is not None else 0.0
            self._rt.call_soon(self._enqueue, group.address, msg)
        else:
            self._gpu_waiter().put((group.address, msg))

    def _flush_transfer(self, transfer_id: str) -> None:
        with self._groups_lock:
            for fp8 in (False, True):
                group = self._groups.pop((transfer_id, fp8), None)
                if group is not None:
                    self._flush(group)

    def _gpu_waiter(self) -> queue.SimpleQueue:
        """A thread that waits for each CUDA gather and then enqueues its message, in
        order. Waiting on the loop instead (polling the event) costs a selector tick per
        message: asyncio cannot sleep for less than its selector's resolution, a millisecond."""
        with self._close_lock:
            if self._waiter is None:
                self._waiter = queue.SimpleQueue()
                threading.Thread(target=self._wait_gathers, args=(self._waiter,), daemon=True,
                                 name="kvtransfer-gpu-waiter").start()
            return self._waiter

    def _wait_gathers(self, todo: queue.SimpleQueue) -> None:
        """Hands each message to the loop once its gather (or, pulled, its layers' compute) is
        done, in order: it waits for the oldest message queued and hands it on with every later
        one already done (``staging.ready_prefix``), so a layer goes out while the layers behind
        it are still computing."""
        pending: collections.deque = collections.deque()
        closing = False
        while pending or not closing:
            while not closing and len(pending) < 64:  # take what is queued; block only when idle
                try:
                    item = todo.get_nowait() if pending else todo.get()
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                else:
                    pending.append(item)
            if not pending:
                continue
            try:
                batch = ready_prefix(pending, lambda item: item[1].ready)
            except Exception as e:  # a failed CUDA context: the transfers fail, the thread goes on
                for _, msg in pending:
                    self._ledger.fail_key(msg.key, KVTransferError(f"KV gather failed: {e}"))
                pending.clear()
                continue
            now = self._pacer.now() if self._pacer is not None else 0.0
            for _, msg in batch:
                msg.ready = None
                msg.ready_at = now
                self._ledger.on_staged(msg.key)
                trace.mark("s.ready", msg.key)
            try:
                self._rt.call_soon(self._enqueue_many, batch)
            except Exception as e:  # runtime gone (closing)
                for _, msg in batch:
                    self._ledger.fail_key(msg.key, KVTransferError(f"sender closed: {e}"))

    def finish(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        self._flush_transfer(transfer_id)  # layers gathered but not yet sent (no last layer came)
        return self._ledger.finish(transfer_id, timeout)

    def metrics(self) -> dict[str, float]:
        out = self._ledger.snapshot()
        out["pacing_delay_seconds"] = self._pacing_delay
        out["connections"] = float(sum(1 for link in self._links.values() if link.ep is not None))
        return out

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            if self._waiter is not None:
                self._waiter.put(None)  # the waiter ends after what it holds
        _LIVE.discard(self)
        try:
            self._rt.call(self._shutdown())
        finally:
            self._ledger.fail_all(KVTransferError("sender closed"))
            UcxRuntime.release()
