"""In-process backend for tests: receivers live in a module-level dict by address and
senders hand them tensors directly. It runs the same wire header checks, handshake,
gather, scatter and bookkeeping as the UCX backend; only the bytes skip the network.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from pdserve.kernels.kv_codec import pack_blocks
from pdserve.kernels.kv_quant import fp8_block_rows
from pdserve.kvtransfer.base import KVCaches, KVSender, TransferResult, wire_fp8
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.layout import (
    FP8_WIRE,
    HEADER_BYTES,
    KVLayout,
    MsgKind,
    NackReason,
    WireHeader,
    check_handshake,
    hello_model,
    pack_hello,
    unpack_header,
    unpack_layout,
)
from pdserve.kvtransfer.ledger import LedgerReceiver, FP8Payload, ReceiveLedger, SendLedger
from pdserve.kvtransfer.pacing import LinkPacer
from pdserve.kvtransfer.staging import as_bytes, block_index, from_bytes, gather_layer

logger = logging.getLogger(__name__)

_RECEIVERS: dict[str, FakeReceiver] = {}
_RECEIVERS_LOCK = threading.Lock()
_NEXT_ID = itertools.count()


class FakeReceiver(LedgerReceiver):
    def __init__(self, kv_caches: KVCaches, model: str = ""):
        self.layout = KVLayout.from_caches(kv_caches)
        self._model = model
        self._caches = kv_caches
        self._ledger = ReceiveLedger(kv_caches, self.layout, on_ack=self._ack, on_nack=self._nack)
        self._address = f"fake://{next(_NEXT_ID)}"
        self._closed = False
        with _RECEIVERS_LOCK:
            _RECEIVERS[self._address] = self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _RECEIVERS_LOCK:
            _RECEIVERS.pop(self._address, None)
        self._ledger.close()

    # called from a FakeSender's thread
    def _handshake(self, hello: bytes) -> bytes:
        header = unpack_header(hello, check_version=False)
        try:
            check_handshake(self.layout, header, unpack_layout(hello[HEADER_BYTES:]), self._model,
                            hello_model(hello, header))
        except KVTransferError as e:
            self._ledger.count("handshake_errors")
            logger.error("rejected a KV sender: %s", e)
            return pack_hello(MsgKind.HELLO_REJECT, self.layout, model=self._model)
        return pack_hello(MsgKind.HELLO_OK, self.layout, model=self._model)

    def _transmit(self, control: bytes, payload: torch.Tensor) -> tuple[WireHeader, list[int], torch.Tensor]:
        """The "wire": check the header and copy the payload into a receiver-side buffer."""
        header = unpack_header(control, expected_fingerprint=self.layout.fingerprint)
        if header.kind != MsgKind.LAYER:
            raise KVTransferError(f"expected a LAYER message, got {header.kind.name}")
        dst_ids = torch.frombuffer(bytearray(control[HEADER_BYTES:]), dtype=torch.int32).tolist()
        precision = "fp8" if header.status & FP8_WIRE else "full"
        if (len(dst_ids) != header.num_blocks
                or header.num_bytes != self.layout.layer_message_bytes(header.num_blocks, precision)):
            raise KVTransferError("LAYER message counts disagree with its header")
        raw = torch.empty(header.num_bytes, dtype=torch.uint8, device=self._caches[0][0].device)
        raw.copy_(payload)
        if precision == "fp8":
            rows = fp8_block_rows(self.layout.block_size, self.layout.head_dim)
            return header, dst_ids, FP8Payload(raw.view(1, 2, header.num_blocks, rows, *self.layout.block_shape[1:]))
        return header, dst_ids, from_bytes(raw, self.layout, header.num_blocks)

    def _land(self, sender: FakeSender, header: WireHeader, dst_ids: list[int], staged) -> None:
        if isinstance(staged, FP8Payload):
            self._ledger.land_many([(header.transfer_key, header.layer, dst_ids, staged, sender)])
        else:
            self._ledger.land(header.transfer_key, header.layer, dst_ids, staged, sender)

    def _ack(self, peers: set, key: int, nbytes: int) -> None:
        for sender in peers:
            sender._ledger.on_ack(key)

    def _nack(self, peers: set, key: int, reason: NackReason) -> None:
        for sender in peers:
            sender._ledger.on_nack(key, reason)


@dataclass
class _Message:
    address: str
    key: int
    control: bytes
    payload: torch.Tensor  # flat uint8
    due: float  # monotonic time at which a paced message has crossed its link


class FakeSender(KVSender):
    """Delivers from a background thread, so ``send_layer`` returns at once as in UCX."""

    def __init__(self, kv_caches: KVCaches, pacer: LinkPacer | None = None, model: str = ""):
        self.layout = KVLayout.from_caches(kv_caches)
        self._model = model
        self._caches = kv_caches
        self._pacer = pacer
        self._ledger = SendLedger()
        self._queue: queue.Queue[_Message | None] = queue.Queue()
        self._connected: dict[str, FakeReceiver] = {}
        self._closed = False
        self._pacing_delay = 0.0
        self._thread = threading.Thread(target=self._run, name="kvtransfer-fake-sender", daemon=True)
        self._thread.start()

    def send_layer(self, address, transfer_id, layer, src_block_ids, dst_block_ids, precision="full") -> None:
        fp8 = wire_fp8(self.layout, precision)
        if self._closed:
            raise KVTransferError("sender is closed")
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.layout.num_layers})")
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks")
        pools = self._caches[layer][0]
        src = block_index(src_block_ids, pools.shape[0], "src_block_ids", pools.device)
        dst = block_index(dst_block_ids, None, "dst_block_ids", torch.device("cpu"))
        due = time.monotonic()
        if self._pacer is not None:  # reserve the link slot now; gather and copy overlap the wait
            nbytes = HEADER_BYTES + 4 * dst.numel() + self.layout.layer_message_bytes(
                dst.numel(), "fp8" if fp8 else "full")
            delay = self._pacer.reserve(address, nbytes)
            self._pacing_delay += delay
            due += delay
        staged = gather_layer(self._caches, layer, src)
        payload = as_bytes(pack_blocks(staged) if fp8 else staged)
        key = self._ledger.on_enqueue(transfer_id, address, payload.numel())
        self._ledger.on_staged(key)
        header = WireHeader(MsgKind.LAYER, key, layer, dst.numel(), payload.numel(), self.layout.fingerprint,
                            status=FP8_WIRE if fp8 else 0)
        control = header.pack() + dst.to(torch.int32).numpy().tobytes()
        self._queue.put(_Message(address, key, control, payload, due))

    def finish(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        return self._ledger.finish(transfer_id, timeout)

    def metrics(self) -> dict[str, float]:
        out = self._ledger.snapshot()
        out["pacing_delay_seconds"] = self._pacing_delay
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._ledger.fail_all(KVTransferError("sender closed"))

    def _connect(self, address: str) -> FakeReceiver:
        receiver = self._connected.get(address)
        if receiver is None:
            with _RECEIVERS_LOCK:
                receiver = _RECEIVERS.get(address)
            if receiver is None:
                raise KVTransferError(f"no fake receiver at {address}")
            reply = receiver._handshake(pack_hello(MsgKind.HELLO, self.layout, model=self._model))
            header = unpack_header(reply, check_version=False)
            try:
                check_handshake(self.layout, header, unpack_layout(reply[HEADER_BYTES:]), self._model,
                                hello_model(reply, header))
            except KVTransferError as e:
                raise KVTransferError(f"KV receiver {address} rejected the handshake: {e}") from None
            self._connected[address] = receiver
        return receiver

    def _run(self) -> None:
        while (msg := self._queue.get()) is not None:
            if self._ledger.should_skip(msg.key):
                continue
            try:
                receiver = self._connect(msg.address)
                self._ledger.on_posted(msg.key)
                landing = receiver._transmit(msg.control, msg.payload)
                if msg.due > time.monotonic():  # paced: land when the message has crossed the link
                    time.sleep(msg.due - time.monotonic())
                receiver._land(self, *landing)
                self._ledger.on_sent(msg.key, msg.payload.numel())
            except KVTransferError as e:
                logger.error("fake KV send to %s failed: %s", msg.address, e)
                self._ledger.fail_key(msg.key, e)
