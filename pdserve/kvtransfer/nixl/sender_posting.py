"""What each NIXL link's sending thread runs: ``SenderPosting``, a base of ``NixlSender``.

The thread (``_drive``) connects, then posts each queued message as the receiver's offer says:

- WRITE: it takes a free slot of the receiver's staging, gathers the layer's source blocks (K
  blocks, then V blocks) into its own mirror of that slot (one copy on the device), WRITEs it as
  one NIXL descriptor (a layer with more blocks than a slot holds goes in several messages) and,
  once NIXL says DONE, sends a LAYER message (status WRITTEN): header, the slot, the destination
  block ids. WRITEs are posted ahead, up to the free slots, and their LAYER messages go in order.
  The sender only ever writes into its connection's staging, never into the pools: a late or stray
  WRITE can spoil nothing but a slot the receiver has not landed yet.
- DIRECT: it WRITEs each message's source blocks straight into the reserved destination blocks:
  one NIXL descriptor per run of consecutive source blocks onto consecutive destination blocks, K
  and V, and every message queued at the time in one transfer (one handle, posted ahead of the
  previous one's DONE). Once NIXL says DONE it sends a LAYER (status DIRECT, ``layers``
  consecutive layers onto the same blocks). A FENCE from the receiver: nothing more is posted for
  its transfer, what is posted finishes, then FENCED.
- READ: a LAYER message (status PULL): header, destination block ids, then source block ids; the
  receiver READs the blocks.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import socket
import threading
import time

import numpy as np
import torch

from pdserve.kernels.kv_codec import pack_blocks
from pdserve.kvtransfer import trace
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.layout import (
    CHECKSUM,
    CHECKSUM_BYTES,
    DIRECT,
    FP8_WIRE,
    PULL,
    WRITTEN,
    MsgKind,
    NackReason,
    WireHeader,
    payload_checksum,
)
from pdserve.kvtransfer.ledger import SendLedger
from pdserve.kvtransfer.nixl.agent import _bind_device, _descs, _wait_xfer
from pdserve.kvtransfer.nixl.control import _FENCE_ID, _MAX_FENCED, _SLOT, FENCED, _send_frame, _send_frames
from pdserve.kvtransfer.pacing import LinkPacer

_MAX_BATCH = 256  # queued messages a DIRECT sender gathers into one WRITE
_WAKE = ("wake",)  # a _Link.queue item: a FENCE came (the sending thread serves it)


class _Link:
    """One receiver, as the sender sees it: a control connection and a thread that sends."""

    def __init__(self, address: str):
        self.address = address
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.error: KVTransferError | None = None
        self.threads: list[threading.Thread] = []
        # WRITE: the receiver's staging as it offered it at handshake, and its free slots
        self.write = False
        self.remote_agent: str | None = None
        self.base = 0
        self.slot_bytes = 0
        self.remote_dev = 0
        self.remote_mem = "DRAM"
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self.local: torch.Tensor | None = None  # WRITE: the sender's gather buffer, slot for slot
        self.local_reg = None
        self.stream = None  # WRITE on CUDA: the stream the gathers run on
        # WRITEs posted and not yet reaped, oldest first: (handle, state, the frames that say they landed,
        # the (key, bytes) of each send_layer message they end)
        self.pending: collections.deque = collections.deque()
        # DIRECT: the receiver's pools ([layers, 2] base addresses) and block count, FENCEs to serve
        # (key, fence id), and the transfer keys fenced so far (newest last; what is queued for them is dropped)
        self.direct = False
        self.remote_pools: np.ndarray | None = None
        self.remote_blocks = 0
        self.fences: collections.deque = collections.deque()
        self.fenced: collections.OrderedDict[int, NackReason] = collections.OrderedDict()


class SenderPosting:
    """``NixlSender``'s methods that run on a link's sending thread (``_drive``) and post its
    messages: staged WRITEs, DIRECT batches and their fences, READ requests; pacing, fault
    injection and the reaping of posted WRITEs in order. The state they use is ``NixlSender``'s."""

    _ledger: SendLedger
    _pacer: LinkPacer | None
    _closed: bool

    def _draw_fault(self, nbytes: int) -> tuple[str | None, int]:
        """The fault injected into the next slot of ``nbytes`` (None without one) and, for
        ``corrupt``, the byte to flip; counted."""
        if self._faults is None:
            return None, 0
        with self._faults_lock:  # one injector for every link's thread
            fault = self._faults.draw()
            flip = self._faults.byte_to_flip(nbytes) if fault == "corrupt" else 0
        if fault is not None:
            self._ledger.count("faults_injected")
        return fault, flip

    def _pace(self, link: _Link, key: int, nbytes: int, ready_at: float) -> None:
        """Records a message of ``key`` posted; on a paced link, first charges ``nbytes`` to its
        bucket and waits out the debt. Its bytes and the link's time on them count as phase
        ``link`` when the bucket, not the compute, held it back (kvtransfer.pacing.LinkHolds)."""
        bucket = self._pacer.bucket_for(link.address) if self._pacer is not None else None
        if bucket is None:
            self._ledger.on_posted(key)
            return
        delay = bucket.reserve(nbytes, ready_at)
        if delay > 0:
            self._pacing_delay += delay
            time.sleep(delay)
        held = self._holds.posted(bucket, self._pacer.now(), delay > 0, ready_at)
        self._ledger.on_posted(key, link_bytes=nbytes if held is not None else 0, link_s=held or 0.0, paced=True)

    def _take_slot(self, link: _Link) -> int:
        """A free staging slot of the receiver (waits for its CREDIT, finishing posted WRITEs
        meanwhile: their slots come back only after their WRITTEN frames); raises once the link
        failed."""
        while True:
            if link.error is not None:
                raise link.error
            if self._closed:
                raise KVTransferError("sender is closed")
            with contextlib.suppress(queue.Empty):
                return link.free.get_nowait()
            if link.pending:
                self._reap(link)
                continue
            try:
                return link.free.get(timeout=0.2)
            except queue.Empty:
                continue

    def _reap(self, link: _Link) -> None:
        """Waits for the oldest posted WRITE's DONE, then sends its WRITTEN frame (and, for a
        message's last frame, counts the message sent)."""
        handle, state, frames, done = link.pending.popleft()
        try:
            _wait_xfer(self._agent, handle, "WRITE", state)
        finally:
            handle.release()
        _send_frames(link.sock, link.lock, frames)
        if trace.ENABLED:
            for key, _ in done:
                trace.mark("s.sent", key)
        for key, nbytes in done:
            self._ledger.on_sent(key, nbytes)

    def _next_item(self, link: _Link):
        """The next queued message; while WRITEs are posted, finishes them until one comes."""
        while link.pending and link.error is None:
            try:
                return link.queue.get_nowait()
            except queue.Empty:
                self._reap_or_fail(link)
        return link.queue.get()

    def _reap_or_fail(self, link: _Link) -> None:
        try:
            self._reap(link)
        except Exception as e:  # OSError, KVTransferError, or NIXL's own: the link fails, not the thread
            self._fail_link(link, e)

    def _fail_link(self, link: _Link, e: Exception) -> None:
        link.error = link.error or (e if isinstance(e, KVTransferError)
                                    else KVTransferError(f"KV receiver {link.address}: {e}"))
        self._ledger.fail_address(link.address, link.error)
        while link.pending:  # the receiver is gone or broke the protocol: what is posted is lost
            with contextlib.suppress(Exception):
                link.pending.popleft()[0].release()

    def _write_layer(self, link: _Link, key: int, layer: int, src: list[int], dst: list[int], fp8: bool = False,
                     ready_at: float = 0.0) -> None:
        """Post the WRITEs of a layer's source blocks into the receiver's staging, as many slots as
        they need: each slot's blocks are first gathered into this side's mirror of the slot (K
        blocks, then V blocks, as the receiver reads the slot), so that a WRITE is one descriptor
        however scattered the blocks are. Each one's WRITTEN frame goes once NIXL says DONE
        (``_reap``), in order; up to a slot per WRITE is in flight, so the next layer's WRITE is
        posted before this one's DONE. ``fp8``: each slot's blocks are quantized after the gather
        (kernels.kv_codec.pack_blocks) and the slot carries those bytes."""
        precision = "fp8" if fp8 else "full"
        wire_block = self.layout.wire_block_bytes(precision)
        per = max(1, link.slot_bytes // (2 * wire_block))
        k_pool, v_pool = self._pools[layer]
        agent = self._agent
        for start in range(0, len(src), per):
            s_ids, d_ids = src[start:start + per], dst[start:start + per]
            n = len(s_ids)
            nb = 2 * n * wire_block
            slot = self._take_slot(link)
            at = slot * link.slot_bytes
            with torch.cuda.stream(link.stream) if link.stream is not None else contextlib.nullcontext():
                # the index is uploaded on the gather's own stream: on the current (the engine's)
                # stream it would wait behind the forward's kernels while the gather read it
                index = torch.tensor(s_ids, dtype=torch.int64, device=self._device)
                if fp8:
                    gathered = torch.empty(2, n, *k_pool.shape[1:], dtype=k_pool.dtype, device=self._device)
                else:
                    gathered = link.local[at:at + nb].view(k_pool.dtype).view(2, n, *k_pool.shape[1:])
                torch.index_select(k_pool, 0, index, out=gathered[0])
                torch.index_select(v_pool, 0, index, out=gathered[1])
                if fp8:
                    link.local[at:at + nb].copy_(pack_blocks(gathered).view(-1))
            if link.stream is not None:
                link.stream.synchronize()
            status, crc = WRITTEN | (FP8_WIRE if fp8 else 0), b""
            if self._checksum and self._device.type == "cpu":
                status |= CHECKSUM
                crc = payload_checksum(link.local[at:at + nb]).to_bytes(CHECKSUM_BYTES, "little")
            last = start + per >= len(src)
            done = [(key, self.layout.layer_message_bytes(len(src), precision))] if last else []
            fault, flip = self._draw_fault(nb)
            if fault == "drop":  # never written; the sender believes it sent it
                link.free.put(slot)
                for k, b in done:
                    self._ledger.on_sent(k, b)
                continue
            if fault == "corrupt":
                link.local[at + flip] ^= 0x5A
            self._pace(link, key, nb, ready_at)
            local = np.array([[link.local.data_ptr() + at, nb, self._dev]], dtype=np.uint64)
            remote = np.array([[link.base + at, nb, link.remote_dev]], dtype=np.uint64)
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, self._mem),
                                           agent.get_xfer_descs(remote, link.remote_mem), link.remote_agent)
            state = agent.transfer(handle)
            header = WireHeader(MsgKind.LAYER, transfer_key=key, layer=layer, num_blocks=n, num_bytes=nb,
                                fingerprint=self.layout.fingerprint, status=status)
            frame = header.pack() + _SLOT.pack(slot) + np.asarray(d_ids, dtype=np.int32).tobytes() + crc
            link.pending.append((handle, state, [frame], done))

    def _gather(self, link: _Link, first) -> tuple[list, bool]:
        """``first`` and the messages queued behind it now (DIRECT: one WRITE carries them all);
        and whether the queue's end (close) came."""
        batch, stop = [first], False
        while len(batch) < _MAX_BATCH:
            try:
                item = link.queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                stop = True
                break
            if item is not _WAKE:  # the FENCE it stands for is served before the batch is posted
                batch.append(item)
        return batch, stop

    def _serve_fences(self, link: _Link) -> None:
        """Each FENCE: nothing more is posted for its transfer, what is posted finishes (its
        frames go), then FENCED."""
        while link.fences:
            key, fence_id, reason = link.fences.popleft()
            link.fenced[key] = NackReason(reason)
            while len(link.fenced) > _MAX_FENCED:
                link.fenced.popitem(last=False)
            while link.pending and link.error is None:
                self._reap_or_fail(link)
            if link.error is None:
                try:
                    _send_frame(link.sock, link.lock, FENCED + _FENCE_ID.pack(fence_id))
                except OSError as e:
                    self._fail_link(link, e)

    def _post_direct(self, link: _Link, batch: list) -> None:
        """One WRITE for every message of ``batch`` still wanted, straight into the receiver's
        reserved blocks."""
        if link.fences:
            self._serve_fences(link)
        ready = []
        for key, layer, src, dst, nbytes, event, _fp8, ready_at in batch:  # DIRECT moves the pools' bytes
            if key in link.fenced:  # the receiver dropped it: fail it as its NACK would
                self._ledger.on_nack(key, link.fenced[key])
                continue
            if self._ledger.should_skip(key):
                continue
            if dst and max(dst) >= link.remote_blocks:
                self._ledger.fail_key(key, KVTransferError(
                    f"destination block id {max(dst)} outside the {link.remote_blocks} blocks of KV receiver "
                    f"{link.address}"))
                continue
            if event is not None and not event.query():
                # what is computed goes now, not behind this layer's compute (the engine
                # queues a forward's layers well before the GPU runs them)
                self._post_ready(link, ready)
                ready = []
                event.synchronize()
            self._ledger.on_staged(key)
            self._pace(link, key, nbytes, ready_at)
            ready.append((key, layer, src, dst, nbytes))
        self._post_ready(link, ready)

    def _post_ready(self, link: _Link, ready: list) -> None:
        if not ready or link.error is not None:
            return
        try:
            self._write_direct(link, ready)
        except Exception as e:  # NIXL's own errors too: the link fails, not the thread
            self._fail_link(link, e)

    def _write_direct(self, link: _Link, ready: list) -> None:
        """Post one WRITE of ``ready``'s blocks (K and V; a run of consecutive source blocks onto
        consecutive destination blocks is one descriptor) and queue the frames that say so."""
        block = np.uint64(self.layout.block_bytes)
        local_parts, remote_parts, done, groups = [], [], [], []
        for key, layer, src, dst, nbytes in ready:
            s_ids, d_ids = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
            cut = np.flatnonzero((np.diff(s_ids) != 1) | (np.diff(d_ids) != 1)) + 1
            starts = np.concatenate(([0], cut))
            size = np.diff(np.append(starts, s_ids.size)).astype(np.uint64) * block
            s_off, d_off = s_ids[starts].astype(np.uint64) * block, d_ids[starts].astype(np.uint64) * block
            for side in (0, 1):
                local_parts.append((self._pool_base[layer, side] + s_off, size))
                remote_parts.append((link.remote_pools[layer, side] + d_off, size))
            done.append((key, nbytes))
            last = groups[-1] if groups else None
            if last is not None and last[0] == key and last[1] + last[2] == layer and last[3] == dst:
                last[2] += 1  # consecutive layers onto the same blocks: one frame
            else:
                groups.append([key, layer, 1, dst])
        agent = self._agent
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(_descs(local_parts, self._dev), self._mem),
                                       agent.get_xfer_descs(_descs(remote_parts, link.remote_dev), link.remote_mem),
                                       link.remote_agent)
        state = agent.transfer(handle)
        if trace.ENABLED:
            for key, layer, *_ in ready:
                trace.mark("s.post", key, layer)
        frames = [WireHeader(MsgKind.LAYER, transfer_key=key, layer=layer, num_blocks=len(dst),
                             num_bytes=n * self.layout.layer_message_bytes(len(dst)),
                             fingerprint=self.layout.fingerprint, status=DIRECT, layers=n).pack()
                  + np.asarray(dst, dtype=np.int32).tobytes() for key, layer, n, dst in groups]
        link.pending.append((handle, state, frames, done))

    def _drive(self, link: _Link) -> None:
        _bind_device(self._device)  # this thread posts the WRITEs
        try:
            stop = False
            while not stop:
                item = self._next_item(link)
                if link.fences:
                    self._serve_fences(link)
                if item is _WAKE:
                    continue
                if item is None:
                    break
                key, layer, src, dst, nbytes, event, fp8, ready_at = item
                if link.error is None and link.sock is None:
                    try:
                        self._connect(link)
                    except (OSError, KVTransferError) as e:
                        link.error = e if isinstance(e, KVTransferError) else KVTransferError(
                            f"cannot reach KV receiver {link.address}: {e}")
                        self._ledger.fail_address(link.address, link.error)
                if link.error is not None:
                    self._ledger.fail_key(key, link.error)
                    continue
                if link.direct:
                    batch, stop = self._gather(link, item)
                    self._post_direct(link, batch)
                    continue
                if self._ledger.should_skip(key):
                    continue
                if event is not None:
                    event.synchronize()
                self._ledger.on_staged(key)
                try:
                    if link.write:  # counted sent when its last WRITTEN frame goes (_reap); paced per slot
                        self._write_layer(link, key, layer, src, dst, fp8, ready_at)
                        continue
                    self._pace(link, key, nbytes, ready_at)
                    header = WireHeader(MsgKind.LAYER, transfer_key=key, layer=layer, num_blocks=len(src),
                                        num_bytes=nbytes, fingerprint=self.layout.fingerprint, status=PULL)
                    _send_frame(link.sock, link.lock, header.pack() + np.asarray(dst + src, dtype=np.int32).tobytes())
                except Exception as e:  # OSError, KVTransferError, or NIXL's own: the link fails, not the thread
                    self._fail_link(link, e)
                    continue
                self._ledger.on_sent(key, nbytes)
            while link.pending and link.error is None:  # what is posted goes before BYE
                self._reap_or_fail(link)
        finally:
            if link.sock is not None:
                try:
                    _send_frame(link.sock, link.lock,
                                WireHeader(MsgKind.BYE, fingerprint=self.layout.fingerprint).pack())
                except OSError:
                    pass
                try:
                    link.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                link.sock.close()
