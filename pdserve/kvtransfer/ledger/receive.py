"""The decode side's bookkeeping: ``ReceiveLedger`` holds every expected transfer (blocks,
deadline, what landed, who sent it), scatters payloads into the pools under a per-transfer lock
and calls the backend's ``on_ack`` / ``on_nack``; ``LedgerReceiver`` is the part of a backend's
receiver that only asks it."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from pdserve.kernels.kv_codec import unpack_blocks
from pdserve.kvtransfer import trace
from pdserve.kvtransfer.base import RECEIVER_PHASES, KVCaches, KVReceiver, TransferResult
from pdserve.kvtransfer.errors import KVTransferCorrupt, KVTransferError, KVTransferTimeout
from pdserve.kvtransfer.layout import KVLayout, NackReason, transfer_key
from pdserve.kvtransfer.ledger.payloads import FP8Payload, InPlace, PullSource
from pdserve.kvtransfer.staging import block_index, copy_layers, scatter_layer, scatter_layers, stacked_pools

logger = logging.getLogger(__name__)

Peer = Hashable
AckFn = Callable[[set, int, int], None]  # (peers, transfer_key, num_bytes)
NackFn = Callable[[set, int, NackReason], None]  # (peers, transfer_key, reason)

_PENDING, _DONE, _FAILED = "pending", "done", "failed"

RECEIVER_COUNTERS = (
    "transfers_expected", "transfers_completed", "transfers_expired", "transfers_cancelled", "transfers_failed",
    "messages_received", "messages_dropped", "bytes_received", "bytes_dropped", "bytes_landed",
    "transfer_seconds", "handshake_errors", "protocol_errors", "pull_links", "messages_pulled", "checksum_failures",
    "messages_fp8", "peers_refused", "messages_written", "messages_direct", "fences", "fence_timeouts",
) + tuple(f"{phase}_seconds" for phase in RECEIVER_PHASES)


@dataclass
class _Incoming:
    transfer_id: str
    key: int
    block_set: frozenset[int]
    num_layers: int
    deadline: float
    landed: list[set[int]]
    state: str = _PENDING
    error: KVTransferError | None = None
    num_bytes: int = 0  # wire bytes landed
    pool_bytes: int = 0  # what they filled in the pools (num_bytes, or more when they came in FP8)
    first_at: float | None = None
    done_at: float | None = None
    scatter_s: float = 0.0
    received_at: float | None = None  # the last payload handed to land()
    peers: set = field(default_factory=set)
    lock: threading.RLock = field(default_factory=threading.RLock)  # held while its blocks are written
    indices: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)  # block ids on the pools' device

    @property
    def complete(self) -> bool:
        return all(len(blocks) == len(self.block_set) for blocks in self.landed)


class ReceiveLedger:
    """Receiver-side state of every expected transfer; thread-safe."""

    def __init__(
        self,
        kv_caches: KVCaches,
        layout: KVLayout,
        on_ack: AckFn | None = None,
        on_nack: NackFn | None = None,
        clock: Callable[[], float] = time.monotonic,
        tombstone_s: float = 300.0,
        max_tombstones: int = 65536,
    ):
        self._caches = kv_caches
        self.stacked = stacked_pools(kv_caches)  # [layers, 2, ...] over the pools, or None
        self._layout = layout
        self._num_blocks = kv_caches[0][0].shape[0]
        self._device = kv_caches[0][0].device
        self._on_ack = on_ack or (lambda peers, key, nbytes: None)
        self._on_nack = on_nack or (lambda peers, key, reason: None)
        self._clock = clock
        self._tombstone_s = tombstone_s
        self._max_tombstones = max_tombstones
        self._cond = threading.Condition()
        self._by_key: dict[int, _Incoming] = {}
        self._by_id: dict[str, _Incoming] = {}
        # transfer key -> (reason, error, forget_at): dropped transfers whose late data is ignored
        self._tombstones: collections.OrderedDict[int, tuple[NackReason, KVTransferError, float]] = (
            collections.OrderedDict()
        )
        self._closed = False
        self.counters: dict[str, float] = dict.fromkeys(RECEIVER_COUNTERS, 0.0)

    # ---- engine side -------------------------------------------------------------------

    def expect(self, transfer_id: str, block_ids: Sequence[int], num_layers: int, deadline_s: float) -> None:
        key = transfer_key(transfer_id)
        index = block_index(block_ids, self._num_blocks, "block_ids", torch.device("cpu"))
        if not isinstance(num_layers, int) or not 1 <= num_layers <= self._layout.num_layers:
            raise ValueError(f"num_layers must be an int in [1, {self._layout.num_layers}], got {num_layers!r}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 seconds, got {deadline_s!r}")
        self._expire_due()
        with self._cond:
            if self._closed:
                raise KVTransferError("receiver is closed")
            if key in self._by_key:
                raise KVTransferError(f"transfer {transfer_id!r} is already expected (or its key collides)")
            self._tombstones.pop(key, None)
            incoming = _Incoming(
                transfer_id, key, frozenset(index.tolist()), num_layers, self._clock() + deadline_s,
                [set() for _ in range(num_layers)],
            )
            self._by_key[key] = incoming
            self._by_id[transfer_id] = incoming
            self.counters["transfers_expected"] += 1

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        wait_end = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                incoming = self._by_id.get(transfer_id)
                if incoming is None:
                    tomb = self._tombstones.get(transfer_key(transfer_id))
                    if tomb is not None:
                        raise tomb[1]
                    raise KVTransferError(f"transfer {transfer_id!r} is not expected by this receiver")
                if incoming.state == _DONE:
                    self._forget(incoming)
                    return self._result(incoming)
                if incoming.state == _FAILED:
                    self._forget(incoming)
                    raise incoming.error
                now = self._clock()
                if now >= incoming.deadline:
                    break
                if wait_end is not None and now >= wait_end:
                    raise KVTransferTimeout(
                        f"wait for transfer {transfer_id!r} timed out after {timeout:.3f}s; "
                        f"it stays expected until its deadline"
                    )
                until = incoming.deadline if wait_end is None else min(incoming.deadline, wait_end)
                self._cond.wait(until - now)
        error = self._drop(incoming, NackReason.DEADLINE_PASSED)
        raise error

    def cancel(self, transfer_id: str) -> None:
        with self._cond:
            incoming = self._by_id.get(transfer_id)
        if incoming is not None:
            self._drop(incoming, NackReason.CANCELLED)

    def drop_reason(self, transfer_id: str) -> NackReason:
        """Why a transfer that is no longer pending was dropped (BAD_MESSAGE when it failed)."""
        with self._cond:
            tomb = self._tombstones.get(transfer_key(transfer_id))
        return tomb[0] if tomb is not None else NackReason.BAD_MESSAGE

    def pending(self, transfer_id: str) -> bool:
        """Whether ``transfer_id`` is expected and still open to its data (not landed, failed,
        cancelled or expired)."""
        with self._cond:
            incoming = self._by_id.get(transfer_id)
            return incoming is not None and incoming.state == _PENDING

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending = list(self._by_key.values())
        for incoming in pending:
            self._drop(incoming, NackReason.RECEIVER_CLOSED)

    def count(self, name: str, value: float = 1.0) -> None:
        with self._cond:
            self.counters[name] += value

    # ---- transport side ----------------------------------------------------------------

    def check_message(self, key: int, layer: int, dst_ids: Sequence[int], peer: Peer) -> NackReason:
        """Whether a LAYER message may land (NONE) or must be dropped (the reason);
        called before its payload is received, and again by ``land``."""
        return self._admit(key, layer, dst_ids, peer)[1]

    def land(self, key: int, layer: int, dst_ids: list[int], staged: torch.Tensor, peer: Peer) -> bool:
        """Scatter ``staged`` ``[2, n, *block_shape]`` into blocks ``dst_ids`` ``[n]`` of
        ``layer`` if the transfer is still live; returns whether it landed. Late or bad
        data is counted and dropped, and the sender is told why."""
        return self.land_many([(key, layer, dst_ids, staged.unsqueeze(0), peer)])[0]

    def land_many(self, items: Sequence[tuple[int, int, list[int], torch.Tensor, Peer]]) -> list[bool]:
        """``land`` for several messages ``(key, first_layer, dst_ids, staged, peer)``, each
        ``staged`` ``[layers, 2, n, *block_shape]`` for the layers from ``first_layer`` on, with one wait:
        every scatter is enqueued on the caller's current stream, the stream is waited for once,
        then the landings are recorded (and acknowledged). Each live transfer's lock is held
        from its first scatter to that wait, so that cancel and expiry, which wait for the lock,
        still promise that nothing is written after they return. On CUDA, call it from a
        thread that may block, with a stream of its own."""
        landed: list[tuple[_Incoming, int, list[int], int]] = []
        copied = False  # a copy was enqueued (in-place messages have none to wait for)
        held: list[_Incoming] = []
        results = [False] * len(items)
        start = time.perf_counter()
        try:
            for i, (key, layer, dst_ids, staged, peer) in enumerate(items):
                pull = isinstance(staged, PullSource)
                fp8 = isinstance(staged, FP8Payload)
                in_place = isinstance(staged, InPlace)
                if in_place:
                    layers = staged.layers
                    nbytes = layers * self._layout.layer_message_bytes(len(dst_ids))
                    self.count("messages_direct")
                elif fp8:
                    nbytes = staged.raw.numel()
                    layers = staged.raw.shape[0]
                    self.count("messages_fp8")
                elif pull:
                    layers = staged.layers
                    nbytes = layers * self._layout.layer_message_bytes(len(dst_ids))
                    self.count("messages_pulled")
                else:
                    nbytes = staged.numel() * staged.element_size()
                    layers = staged.shape[0]
                self.count("messages_received")
                self.count("bytes_received", nbytes)
                incoming, reason = self._admit(key, layer, dst_ids, peer, layers)
                if pull and incoming is not None and reason == NackReason.NONE:
                    remote_blocks = staged.pools.shape[2]
                    if (len(staged.src_ids) != len(dst_ids) or self.stacked is None
                            or not all(0 <= b < remote_blocks for b in staged.src_ids)):
                        self._fail(incoming, KVTransferError(
                            f"transfer {incoming.transfer_id!r}: bad message: source block ids do not match "
                            f"the destination ids or lie outside the sender's {remote_blocks} blocks"))
                        reason = NackReason.BAD_MESSAGE
                if incoming is not None and reason == NackReason.NONE:
                    incoming.lock.acquire()
                    held.append(incoming)
                    if incoming.state == _PENDING:
                        if not in_place:  # an in-place message is already in the blocks
                            self._copy_in(incoming, key, layer, layers, dst_ids, staged)
                        landed.append((incoming, range(layer, layer + layers), dst_ids, nbytes,
                                       layers * self._layout.layer_message_bytes(len(dst_ids))))
                        copied = copied or not in_place
                        results[i] = True
                        continue
                    if incoming.state == _DONE:  # a duplicate after completion: harmless, nobody to tell
                        reason = NackReason.NONE
                    else:
                        reason = NackReason.CANCELLED if incoming.error is None else NackReason.BAD_MESSAGE
                self.count("messages_dropped")
                self.count("bytes_dropped", nbytes)
                logger.debug("dropped KV message for transfer key %#x layer %d: %s", key, layer, reason.name)
                if reason != NackReason.NONE:
                    self._on_nack({peer}, key, reason)
            if trace.ENABLED:
                for incoming, layers, *_ in landed:
                    trace.mark("r.launched", incoming.key, layers.start)
            if copied and self._device.type == "cuda":
                torch.cuda.current_stream(self._device).synchronize()
            trace.flush_gpu_timers()
            if trace.ENABLED:
                for incoming, layers, *_ in landed:
                    trace.mark("r.copied", incoming.key, layers.start)
            elapsed = time.perf_counter() - start
            received_at = self._clock()
            for incoming, layer, dst_ids, nbytes, pool_bytes in landed:
                incoming.scatter_s += elapsed / len(landed)
                incoming.received_at = received_at
                self._record_landing(incoming, layer, dst_ids, nbytes, pool_bytes)
        finally:
            for incoming in held:
                incoming.lock.release()
        return results

    def _copy_in(self, incoming: _Incoming, key: int, layer: int, layers: int, dst_ids: list[int], staged) -> None:
        """Enqueue the copy of a message's blocks into ``dst_ids`` of ``layers`` layers from ``layer``:
        from the sender's pools (PullSource), dequantized (FP8Payload), or scattered from staging."""
        index = self._index(incoming, dst_ids)
        if isinstance(staged, FP8Payload):  # dequantized on landing, into the pools' dtype
            staged = unpack_blocks(staged.raw, self._layout.torch_dtype)
        if isinstance(staged, PullSource):
            src_index = self._index(incoming, staged.src_ids)
            trace.mark("r.indexed", key, layer)
            timer = trace.gpu_timer(self._device)
            copy_layers(staged.pools, self.stacked, layer, layers, src_index, index)
            trace.gpu_timer_stop(timer, "r.kernel", key, layer)
        elif self.stacked is not None:
            scatter_layers(self.stacked, layer, index, staged)
        else:
            for offset in range(layers):
                scatter_layer(self._caches, layer + offset, index, staged[offset])

    def _index(self, incoming: _Incoming, ids: list[int]) -> torch.Tensor:
        """Block ids ``ids`` (destination, or a pull's source) as an index on the pools' device,
        built once per transfer and block list (every layer of a chunk uses the same blocks)."""
        key = tuple(ids)
        index = incoming.indices.get(key)
        if index is None:
            index = incoming.indices[key] = torch.tensor(key, dtype=torch.int64, device=self._device)
        return index

    def _admit(self, key: int, layer: int, dst_ids: Sequence[int], peer: Peer,
               layers: int = 1) -> tuple[_Incoming | None, NackReason]:
        self._expire_due()
        with self._cond:
            incoming = self._by_key.get(key)
            if incoming is None:
                tomb = self._tombstones.get(key)
                return None, (tomb[0] if tomb is not None else NackReason.UNKNOWN_TRANSFER)
            if incoming.state == _FAILED:
                return incoming, NackReason.BAD_MESSAGE
            if incoming.state == _DONE:
                return incoming, NackReason.NONE
            incoming.peers.add(peer)
            if incoming.first_at is None:
                incoming.first_at = self._clock()
        dst_set = set(dst_ids)
        if not (0 <= layer and layers >= 1 and layer + layers <= incoming.num_layers):
            problem = f"layers [{layer}, {layer + layers}) outside [0, {incoming.num_layers})"
        elif len(dst_set) != len(dst_ids) or not dst_set <= incoming.block_set:
            problem = "destination block ids are duplicated or not reserved for it"
        else:
            return incoming, NackReason.NONE
        self._fail(incoming, KVTransferError(f"transfer {incoming.transfer_id!r}: bad message: {problem}"))
        return incoming, NackReason.BAD_MESSAGE

    def reject_corrupt(self, key: int, layer: int, peer: Peer) -> None:
        """A payload of transfer ``key`` failed its checksum: the transfer fails (its waiter sees
        KVTransferCorrupt, its senders a NACK ``CORRUPT``) and nothing more lands in its blocks."""
        with self._cond:
            self.counters["checksum_failures"] += 1
            incoming = self._by_key.get(key)
            if incoming is not None:
                incoming.peers.add(peer)
        if incoming is None:
            self._on_nack({peer}, key, NackReason.CORRUPT)
            return
        with incoming.lock:  # a scatter of an earlier message finishes first
            self._fail(incoming, KVTransferCorrupt(
                f"transfer {incoming.transfer_id!r}: the payload of layer {layer} failed its checksum; "
                "its KV is not used"), NackReason.CORRUPT)

    # ---- internals ---------------------------------------------------------------------

    def _record_landing(self, incoming: _Incoming, layers: range, dst_ids: Sequence[int], nbytes: int,
                        pool_bytes: int) -> None:
        """``nbytes``: the wire bytes that landed; ``pool_bytes``: what they fill in the pools
        (more when they came in FP8)."""
        with self._cond:
            for layer in layers:
                incoming.landed[layer].update(dst_ids)
            incoming.num_bytes += nbytes
            incoming.pool_bytes += pool_bytes
            if not incoming.complete:
                return
            expected = incoming.num_layers * self._layout.layer_message_bytes(len(incoming.block_set))
            assert incoming.pool_bytes >= expected, "complete coverage implies the bytes landed"
            incoming.state = _DONE
            incoming.done_at = self._clock()
            peers = set(incoming.peers)
            self.counters["transfers_completed"] += 1
            self.counters["bytes_landed"] += incoming.num_bytes
            self.counters["transfer_seconds"] += incoming.done_at - (incoming.first_at or incoming.done_at)
            for phase, seconds in self._phases(incoming).items():
                self.counters[f"{phase}_seconds"] += seconds
            self._cond.notify_all()
        self._on_ack(peers, incoming.key, incoming.num_bytes)

    def _fail(self, incoming: _Incoming, error: KVTransferError, reason: NackReason = NackReason.BAD_MESSAGE) -> None:
        with self._cond:
            if incoming.state != _PENDING:
                return
            incoming.state, incoming.error = _FAILED, error
            peers = set(incoming.peers)
            self.counters["transfers_failed"] += 1
            self._cond.notify_all()
        logger.warning("%s", error)
        self._on_nack(peers, incoming.key, reason)

    def _drop(self, incoming: _Incoming, reason: NackReason) -> KVTransferError:
        """Forget ``incoming``, leave a tombstone so late data is dropped, and wait for a
        scatter in progress; returns the error that waiters see."""
        if reason == NackReason.DEADLINE_PASSED:
            error = KVTransferTimeout(f"transfer {incoming.transfer_id!r} missed its deadline; late data is dropped")
        else:
            error = KVTransferError(f"transfer {incoming.transfer_id!r} dropped: {reason.name.lower()}")
        with self._cond:
            was_pending = incoming.state == _PENDING
            if was_pending:
                incoming.state, incoming.error = _FAILED, error
                counter = {NackReason.DEADLINE_PASSED: "transfers_expired", NackReason.CANCELLED: "transfers_cancelled"}
                self.counters[counter.get(reason, "transfers_failed")] += 1
            self._forget(incoming)
            self._tombstones[incoming.key] = (reason, error, self._clock() + self._tombstone_s)
            while len(self._tombstones) > self._max_tombstones:
                self._tombstones.popitem(last=False)
            peers = set(incoming.peers)
            self._cond.notify_all()
        with incoming.lock:  # a scatter in progress finishes before we return
            pass
        if was_pending and peers:
            self._on_nack(peers, incoming.key, reason)
        return error if was_pending else (incoming.error or error)

    def _forget(self, incoming: _Incoming) -> None:
        if self._by_key.get(incoming.key) is incoming:
            del self._by_key[incoming.key]
        if self._by_id.get(incoming.transfer_id) is incoming:
            del self._by_id[incoming.transfer_id]

    def _expire_due(self) -> None:
        now = self._clock()
        with self._cond:
            due = [t for t in self._by_key.values() if t.state == _PENDING and now >= t.deadline]
            while self._tombstones:
                key, (_, _, forget_at) = next(iter(self._tombstones.items()))
                if forget_at > now:
                    break
                del self._tombstones[key]
        for incoming in due:
            self._drop(incoming, NackReason.DEADLINE_PASSED)

    @staticmethod
    def _phases(incoming: _Incoming) -> dict[str, float]:
        done = incoming.done_at or 0.0
        return {"scatter": incoming.scatter_s, "land": max(0.0, done - (incoming.received_at or done))}

    def _result(self, incoming: _Incoming) -> TransferResult:
        seconds = (incoming.done_at or 0.0) - (incoming.first_at or incoming.done_at or 0.0)
        return TransferResult.of(incoming.transfer_id, incoming.num_bytes, seconds, self._phases(incoming),
                                 finished_at=incoming.done_at or 0.0)

    def snapshot(self) -> dict[str, float]:
        with self._cond:
            out = dict(self.counters)
            out["transfers_pending"] = float(len(self._by_key))
            return out


class LedgerReceiver(KVReceiver):
    """A receiver whose transfers a `ReceiveLedger` (``self._ledger``) accounts for, at the
    address ``self._address``: what every backend's receiver answers the same way. A backend
    adds its transport (and its own metrics where it counts more)."""

    _ledger: ReceiveLedger
    _address: str

    def address(self) -> str:
        return self._address

    def expect(self, transfer_id: str, block_ids: Sequence[int], num_layers: int, deadline_s: float) -> None:
        self._ledger.expect(transfer_id, block_ids, num_layers, deadline_s)

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        return self._ledger.wait(transfer_id, timeout)

    def cancel(self, transfer_id: str) -> None:
        self._ledger.cancel(transfer_id)

    def metrics(self) -> dict[str, float]:
        return self._ledger.snapshot()
