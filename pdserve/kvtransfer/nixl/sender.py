"""The NIXL backend's sender (prefill side): ``NixlSender``, what the engine's threads call, and
each link's control path.

``send_layer`` checks a layer's blocks and queues them on the receiver's link (``_Link``), whose
sending thread connects and posts them (``SenderPosting``, ``pdserve.kvtransfer.nixl.sender_posting``).
Connecting, on that thread: the sender answers the receiver's opening (the cluster token's
challenge), sends HELLO (wire version, layout, model, and as transport data its NIXL agent's
metadata, the addresses of its K and V pools and the op it asks for) and takes what HELLO_OK
offers: the receiver's pools (DIRECT), staging slots of its own (WRITE) or neither (READ). A reader
thread per link takes ACK, NACK, CREDIT and FENCE frames.

FP8 on the wire (``precision="fp8"``): the staged WRITE quantizes a slot's gathered blocks
(kernels.kv_codec.pack_blocks, the UCX backend's wire format) into the slot's mirror and WRITEs
those bytes; its WRITTEN frame carries ``FP8_WIRE`` and the receiver dequantizes on landing
(ledger.FP8Payload). DIRECT writes into the pools and READ reads from them, so those two move
the pool's bytes as they are (and the transfer reports full precision).

Pacing (``pacer=``, a kvtransfer.pacing.LinkPacer or a spec string, as the UCX backend takes):
before each WRITE (a staged slot, or a DIRECT batch) or READ request goes, the link's token
bucket is charged its bytes and the sender waits out any debt; the bytes and time the bucket
held back are the transfer's phase ``link``, as on UCX (launcher.paced's emulated links).

Checksums (``checksum=``, by default on CPU pools, as on UCX): a staged WRITE's WRITTEN frame
carries the CRC-32 of its slot's bytes (``CHECKSUM``); a receiver that finds other bytes in the
slot fails the transfer (NACK ``CORRUPT``) and lands nothing of it. Fault injection
(``faults=``, kvtransfer.faults) on the staged WRITE: ``drop`` (the slot is never written, the
message counts as sent) and ``corrupt`` (a byte of the slot flipped after its checksum). DIRECT
and READ take neither, nor ``duplicate`` or ``reorder``: a slot's bytes are only ever written once.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
from typing import Sequence

import numpy as np
import torch

from pdserve.kvtransfer import auth
from pdserve.kvtransfer.base import KVCaches, KVSender, TransferResult, wire_fp8
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.faults import FaultInjector
from pdserve.kvtransfer.layout import (
    DIRECT,
    HEADER_BYTES,
    LAYOUT_BYTES,
    PULL,
    KVLayout,
    MsgKind,
    NackReason,
    check_handshake,
    hello_extra,
    hello_model,
    pack_hello,
    unpack_header,
    unpack_layout,
)
from pdserve.kvtransfer.ledger import SendLedger
from pdserve.kvtransfer.nixl.agent import _agent, _mem, _pools, _pool_addresses, _register, _warn_on_cuda, load_nixl
from pdserve.kvtransfer.nixl.control import (
    _AUTH_FP, _FENCE, _SLOT, AUTH_CHALLENGE, AUTH_NONE, AUTH_OK, AUTH_REFUSED, CREDIT, FENCE, _recv_frame, _refused,
    _send_frame, parse_address,
)
from pdserve.kvtransfer.nixl.sender_posting import _WAKE, SenderPosting, _Link
from pdserve.kvtransfer.pacing import LinkHolds, LinkPacer
from pdserve.kvtransfer.staging import block_index

logger = logging.getLogger(__name__)

OPS = ("direct", "write", "read")


class NixlSender(SenderPosting, KVSender):
    def __init__(self, kv_caches: KVCaches, connect_timeout: float = 5.0, model: str = "",
                 token: str | None = None, op: str = "write", pacer: LinkPacer | None = None,
                 checksum: bool | None = None, faults=None):
        """`token`: the cluster's secret, proved to each receiver (None: a cluster without one);
        `op`: ``"write"`` (the default: the sender gathers the blocks and WRITEs them into the
        receiver's staging, which it copies into the blocks), ``"direct"`` (the sender WRITEs
        straight into the receiver's reserved blocks, a descriptor per run of consecutive blocks)
        or ``"read"`` (the receiver READs the sender's pools); the receiver answers which it takes.
        `pacer`: emulated links' token buckets by receiver address; `checksum` (default: on for CPU
        pools) and `faults` (a kvtransfer.faults spec: drop and corrupt): the staged WRITE's
        (module docstring)."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        if pacer is not None and not isinstance(pacer, LinkPacer):
            raise ValueError(f"pacer must be a kvtransfer.pacing.LinkPacer, got {type(pacer).__name__}")
        self._pacer = pacer
        self._pacing_delay = 0.0
        self._holds = LinkHolds()  # which posts the paced links held back (phase "link")
        self._faults = FaultInjector(faults) if faults else None
        if self._faults is not None and (self._faults.spec.duplicate or self._faults.spec.reorder):
            raise ValueError("faults: the NIXL backend injects drop and corrupt only (a staging slot is written once)")
        self._faults_lock = threading.Lock()
        api = load_nixl()
        self._op = op
        self._token = token
        self._pools = _pools(kv_caches)
        self.layout = KVLayout.from_caches(kv_caches)
        self._device = self._pools[0][0].device
        self._mem, self._dev = _mem(self._device)
        self._checksum = self._device.type == "cpu" if checksum is None else bool(checksum)
        self._num_blocks = self._pools[0][0].shape[0]
        self._model = model
        self._connect_timeout = connect_timeout
        self._ledger = SendLedger()
        self._agent = _agent(api, "send")
        self._reg = _register(self._agent, self._pools, self._mem, self._dev)
        self._pool_base = np.array(_pool_addresses(self._pools), dtype=np.uint64)
        self._hello_extra = json.dumps({
            "metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
            "pools": _pool_addresses(self._pools),
            "dev": self._dev, "mem": self._mem, "op": op,
        }).encode()
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()
        self._closed = False

    def send_layer(self, address: str, transfer_id: str, layer: int, src_block_ids: Sequence[int],
                   dst_block_ids: Sequence[int], precision: str = "full") -> None:
        fp8 = wire_fp8(self.layout, precision)  # validates; FP8 only on the staged WRITE (module docstring)
        if self._closed:
            raise KVTransferError("sender is closed")
        parse_address(address)
        if not isinstance(layer, int) or not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer!r} out of range [0, {self.layout.num_layers})")
        src = block_index(src_block_ids, self._num_blocks, "src_block_ids", torch.device("cpu")).tolist()
        dst = block_index(dst_block_ids, None, "dst_block_ids", torch.device("cpu")).tolist()
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
        nbytes = self.layout.layer_message_bytes(len(src))
        key = self._ledger.on_enqueue(transfer_id, address, nbytes)
        event = None
        if self._device.type == "cuda":  # the receiver reads the blocks once the kernels that wrote them ran
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        ready_at = self._pacer.now() if self._pacer is not None else 0.0
        self._link(address).queue.put((key, layer, src, dst, nbytes, event, fp8, ready_at))

    def finish(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        return self._ledger.finish(transfer_id, timeout)

    def metrics(self) -> dict[str, float]:
        out = self._ledger.snapshot()
        if self._pacer is not None:
            out["pacing_delay_seconds"] = self._pacing_delay
        if self._faults is not None:
            out.update({f"faults_{kind}": float(n) for kind, n in self._faults.counts.items()})
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.queue.put(None)
        for link in links:
            link.threads[0].join(10)  # the sending thread: it says BYE and closes the connection
            for t in link.threads[1:]:
                t.join(10)
        self._ledger.fail_all(KVTransferError("sender closed"))
        if self._agent is not None:
            for link in links:
                if link.local_reg is not None:
                    self._agent.deregister_memory(link.local_reg)
            self._agent.deregister_memory(self._reg)
            self._agent = None

    def _link(self, address: str) -> _Link:
        with self._lock:
            link = self._links.get(address)
            if link is None:
                link = self._links[address] = _Link(address)
                t = threading.Thread(target=self._drive, args=(link,), name="kvtransfer-nixl-send", daemon=True)
                link.threads.append(t)
                t.start()
            return link

    def _connect(self, link: _Link) -> None:
        host, port, incarnation = parse_address(link.address)
        sock = socket.create_connection((host, port), timeout=self._connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link.sock = sock
        self._prove(link)
        _send_frame(sock, link.lock, pack_hello(MsgKind.HELLO, self.layout, extra=self._hello_extra,
                                                model=self._model, incarnation=incarnation))
        answer = _recv_frame(sock)
        if answer is None:
            raise KVTransferError(f"KV receiver {link.address} closed the connection during the handshake")
        header = unpack_header(answer, check_version=False)
        if header.kind == MsgKind.HELLO_REJECT:
            peer = unpack_layout(answer[HEADER_BYTES:HEADER_BYTES + LAYOUT_BYTES])
            check_handshake(self.layout, header, peer, self._model, hello_model(answer, header))
            raise KVTransferError(f"KV receiver {link.address} refused this sender: "
                                  f"{hello_extra(answer, header).decode(errors='replace')}")
        if header.kind != MsgKind.HELLO_OK:
            raise KVTransferError(f"expected HELLO_OK from {link.address}, got {header.kind.name}")
        if header.layers != incarnation:
            raise KVTransferError(f"KV receiver {link.address} restarted (another incarnation)")
        if header.status & DIRECT:  # the receiver offers its pools for WRITEs into the reserved blocks
            offer = json.loads(hello_extra(answer, header))
            link.remote_agent = self._agent.add_remote_agent(base64.b64decode(offer["metadata"]))
            link.remote_pools = np.array(offer["pools"], dtype=np.uint64).reshape(self.layout.num_layers, 2)
            link.remote_blocks = int(offer["blocks"])
            link.remote_dev, link.remote_mem = int(offer["dev"]), offer["mem"]
            for key, reason in offer.get("fenced", []):
                link.fenced[int(key)] = NackReason(int(reason))
            link.direct = True
        elif not header.status & PULL:  # the receiver offers staging for WRITEs
            offer = json.loads(hello_extra(answer, header))
            link.remote_agent = self._agent.add_remote_agent(base64.b64decode(offer["metadata"]))
            link.base, link.slot_bytes = int(offer["base"]), int(offer["slot_bytes"])
            link.remote_dev, link.remote_mem = int(offer["dev"]), offer["mem"]
            slots = int(offer["slots"])
            for slot in range(slots):
                link.free.put(slot)
            # this side's mirror of the receiver's slots: a slot's blocks are gathered here (one copy
            # on the device) and go in one descriptor; slot i is reused only once the receiver hands
            # slot i back, after the WRITE from it was DONE
            link.local = torch.empty(slots * link.slot_bytes, dtype=torch.uint8, device=self._device)
            link.local_reg = self._agent.register_memory(
                [(link.local.data_ptr(), link.local.numel(), self._dev, "")], self._mem)
            if self._device.type == "cuda":
                link.stream = torch.cuda.Stream(self._device)
            link.write = True
        _warn_on_cuda(self._device, "direct" if link.direct else "write" if link.write else "read")
        sock.settimeout(None)
        reader = threading.Thread(target=self._read, args=(link,), name="kvtransfer-nixl-ack", daemon=True)
        link.threads.append(reader)
        reader.start()

    def _prove(self, link: _Link) -> None:
        """Answers the receiver's opening: its challenge with this sender's proof of the token."""
        opening = _recv_frame(link.sock)
        if opening is None:
            raise KVTransferError(f"KV receiver {link.address} closed the connection before the handshake")
        kind, rest = opening[:5], opening[5:]
        if kind == AUTH_REFUSED:
            raise _refused(link.address, rest.decode(errors="replace"))
        if kind == AUTH_NONE:
            if self._token is not None:  # it proves nothing: a cluster uses a token on every worker or none
                raise _refused(link.address, "cluster token mismatch: the receiver has no cluster token")
            return
        if kind != AUTH_CHALLENGE or len(rest) != auth.NONCE_BYTES:
            raise KVTransferError(f"KV receiver {link.address} opened with an unknown message")
        if self._token is None:
            raise _refused(link.address, "cluster token mismatch: the receiver requires one, this sender has none")
        client_nonce = auth.new_nonce()
        _send_frame(link.sock, link.lock, client_nonce + auth.sender_proof(self._token, rest, client_nonce, _AUTH_FP))
        answer = _recv_frame(link.sock)
        if answer is None:
            raise KVTransferError(f"KV receiver {link.address} closed the connection during the handshake")
        if answer[:5] == AUTH_REFUSED:
            raise _refused(link.address, answer[5:].decode(errors="replace"))
        expected = auth.receiver_proof(self._token, rest, client_nonce, _AUTH_FP)
        if answer[:5] != AUTH_OK or not auth.verify(expected, answer[5:]):
            raise _refused(link.address, "cluster token mismatch: the receiver's proof is wrong")

    def _read(self, link: _Link) -> None:
        try:
            while True:
                frame = _recv_frame(link.sock)
                if frame is None:
                    break
                if frame[:len(CREDIT)] == CREDIT:
                    link.free.put(_SLOT.unpack_from(frame, len(CREDIT))[0])
                    continue
                if frame[:len(FENCE)] == FENCE:
                    if len(frame) != len(FENCE) + _FENCE.size:
                        raise KVTransferError("bad FENCE message")
                    link.fences.append(_FENCE.unpack_from(frame, len(FENCE)))
                    link.queue.put(_WAKE)  # the sending thread serves it
                    continue
                header = unpack_header(frame)
                if header.kind == MsgKind.ACK:
                    self._ledger.on_ack(header.transfer_key)
                elif header.kind == MsgKind.NACK:
                    self._ledger.on_nack(header.transfer_key, NackReason(header.status))
        except (OSError, KVTransferError, ValueError) as e:
            logger.debug("NIXL KV control path to %s: %s", link.address, e)
        error = KVTransferError(f"KV receiver {link.address} closed the connection")
        link.error = link.error or error
        self._ledger.fail_address(link.address, link.error)
