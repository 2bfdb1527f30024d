"""The NIXL backend's receiver (decode side): ``NixlReceiver``.

It accepts a TCP connection per sender, admits it (the interface it arrived on, then the cluster
token) and checks its HELLO like the UCX receiver (``handshake_errors``, HELLO_REJECT naming what
differs); then it serves the op the sender asks for:

- DIRECT (``op="direct"``): the receiver registers its pools with its agent once and answers
  HELLO_OK (status DIRECT) with its agent's metadata and the pools' addresses. A LAYER (status
  DIRECT, ``layers`` consecutive layers onto the same blocks: header and destination block ids)
  says the sender's WRITE into them is DONE; it is checked against the transfer (a drop is
  counted and NACKed) and the landing recorded: there is no copy on the receiving side. Since the
  bytes are in the pool before the receiver sees the message, a dropped transfer (cancelled,
  expired, failed) is *fenced* before its blocks go back to the engine (``cancel`` and ``wait``):
  every DIRECT sender gets FENCE (the transfer's key and the reason); it drops what it has queued
  for that transfer, waits for everything it posted to be DONE and answers FENCED. A sender that
  does not answer within ``fence_timeout`` is disconnected; a sender that connects later is told
  the recent fences in HELLO_OK. What a DIRECT receiver trusts: that an authenticated sender
  writes only the destination ids it was given for a live transfer (the router's reservation); a
  sender given ids that were never reserved writes them before the NACK.
- WRITE (``op="write"``, the default): HELLO_OK carries the agent's metadata and a staging buffer
  of the receiver's own for this connection (``slots`` slots of ``slot_bytes``, registered once).
  A LAYER (status WRITTEN: header, the slot, the destination block ids) is checked against the
  transfer it expects (unknown id, blocks not reserved, deadline passed: NACK), the ledger
  scatters the slot into the reserved blocks under the transfer's lock (so a cancel or an expired
  deadline still promises that nothing is written into the pools after it returns), and the
  receiver hands the slot back (a CREDIT frame). A connection's staging is kept until the
  receiver closes (a dead or hung sender's WRITE may still be in flight). A slot whose CRC-32
  (``CHECKSUM``) does not match fails the transfer (NACK ``CORRUPT``) and lands nothing of it; an
  FP8 slot (``FP8_WIRE``) is dequantized on landing (ledger.FP8Payload).
- READ (``op="read"``; what a receiver that does not offer staging gets): a LAYER (status PULL:
  header, destination block ids, then source block ids) is checked, the receiver READs the source
  blocks from the sender's registered pools into a staging buffer and the ledger scatters them as
  above.

When a transfer has landed the receiver sends ACK to every sender that contributed.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import logging
import os
import socket
import threading
import time

import numpy as np
import torch

from pdserve.kernels.kv_quant import fp8_block_rows
from pdserve.kvtransfer import auth, trace
from pdserve.kvtransfer import layout as wire
from pdserve.kvtransfer.base import KVCaches, TransferResult
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.settings import current as kv_settings
from pdserve.kvtransfer.layout import (
    CHECKSUM,
    CHECKSUM_BYTES,
    DIRECT,
    FP8_WIRE,
    HEADER_BYTES,
    LAYOUT_BYTES,
    PULL,
    WRITTEN,
    KVLayout,
    MsgKind,
    NackReason,
    WireHeader,
    handshake_mismatches,
    hello_extra,
    hello_model,
    pack_hello,
    payload_checksum,
    transfer_key,
    unpack_header,
    unpack_layout,
)
from pdserve.kvtransfer.ledger import FP8Payload, InPlace, LedgerReceiver, ReceiveLedger
from pdserve.kvtransfer.nixl.agent import (
    _agent, _bind_device, _mem, _own_stream, _pool_addresses, _pools, _register, _wait_xfer, load_nixl,
)
from pdserve.kvtransfer.nixl.control import (
    _AUTH_FP, _FENCE, _FENCE_ID, _FENCED_KEEP_S, _MAX_FENCED, _SLOT, AUTH_CHALLENGE, AUTH_NONE, AUTH_OK, AUTH_REFUSED,
    CREDIT, FENCE, FENCE_TIMEOUT_S, FENCED, SCHEME, _recv_frame, _send_frame,
)

logger = logging.getLogger(__name__)


def _slot_config() -> tuple[int, int]:
    """(slot bytes, slots) of a WRITE connection's staging, from the process's KV settings."""
    settings = kv_settings()
    return settings.nixl_slot_bytes, settings.nixl_slots


class _RecvConn:
    """One sender, as the receiver sees it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.remote_agent: str | None = None
        self.pools: np.ndarray | None = None  # [layers, 2] base addresses of the sender's pools
        self.remote_dev = 0
        self.remote_mem = "DRAM"
        self.staging: torch.Tensor | None = None
        self.staging_reg = None
        self.write = False  # the sender WRITEs into this connection's staging slots
        self.direct = False  # the sender WRITEs straight into the reserved blocks (and answers FENCE)
        self.slot_bytes = 0
        self.slots = 0

    def send(self, data: bytes) -> None:
        try:
            _send_frame(self.sock, self.lock, data)
        except OSError:
            pass  # the sender is gone; its transfers fail on its side


class NixlReceiver(LedgerReceiver):
    def __init__(self, kv_caches: KVCaches, host: str = "127.0.0.1", port: int = 0, connect_timeout: float = 5.0,
                 model: str = "", token: str | None = None, interface: str | None = None,
                 fence_timeout: float = FENCE_TIMEOUT_S):
        """`token`: the cluster's secret, which every sender must prove (None: nothing checked);
        `interface`: the local address(es) a connection must arrive on (default `host`; "any": any);
        `fence_timeout`: seconds a dropped transfer waits for its DIRECT senders (``_fence``)."""
        api = load_nixl()
        self._token = token
        self._allowed = auth.allowed_addresses(host, interface)
        self._pools = _pools(kv_caches)
        self.layout = KVLayout.from_caches(kv_caches)
        self._device = self._pools[0][0].device
        self._mem, self._dev = _mem(self._device)
        self._model = model
        self._connect_timeout = connect_timeout
        self._ledger = ReceiveLedger(kv_caches, self.layout, on_ack=self._ack, on_nack=self._nack)
        self._agent = _agent(api, "recv")
        self._pool_reg = None  # the pools, registered for DIRECT senders at the first one's handshake
        self._fence_cond = threading.Condition()
        self._fencing: dict[int, set[_RecvConn]] = {}  # fence id -> DIRECT connections yet to answer
        self._fence_seq = 0
        # transfer key -> (NackReason, when) of the recent fences: a DIRECT sender that connects later
        # learns them at handshake (under self._lock, like the fence's choice of connections)
        self._fenced: collections.OrderedDict[int, tuple[int, float]] = collections.OrderedDict()
        self.fence_timeout = fence_timeout
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.2)
        self.incarnation = int.from_bytes(os.urandom(4), "little") or 1
        self._address = f"{SCHEME}{host}:{self._listener.getsockname()[1]}/{self.incarnation:08x}"
        self._closed = threading.Event()
        self._conns: set[_RecvConn] = set()
        self._retired: list[_RecvConn] = []  # closed WRITE connections: their staging stays (see the docstring)
        self._lock = threading.Lock()
        self._accept = threading.Thread(target=self._accept_loop, name="kvtransfer-nixl-accept", daemon=True)
        self._accept.start()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._ledger.close()
        self._listener.close()
        self._accept.join(5)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        for conn in conns:
            if conn.thread is not None:
                conn.thread.join(5)
        with self._fence_cond:
            self._fence_cond.notify_all()
        self._agent = None

    # ---- DIRECT senders: what a dropped transfer waits for -------------------------------

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        try:
            return self._ledger.wait(transfer_id, timeout)
        except KVTransferError:
            if not self._ledger.pending(transfer_id):  # failed, expired or dropped: its blocks go back
                self._fence(transfer_id, self._ledger.drop_reason(transfer_id))
            raise

    def cancel(self, transfer_id: str) -> None:
        self._ledger.cancel(transfer_id)
        self._fence(transfer_id, NackReason.CANCELLED)

    def _fence(self, transfer_id: str, reason: NackReason) -> None:
        """Before a dropped transfer's blocks go back to the engine: every DIRECT sender stops
        writing into them. Each is sent FENCE; it skips what it has queued for the transfer,
        waits for what it posted to be DONE and answers FENCED. A sender that does not answer
        within ``fence_timeout`` is disconnected (its link fails, and it posts nothing more)."""
        key, now = transfer_key(transfer_id), time.monotonic()
        with self._lock:  # kept even with no DIRECT sender yet: one that connects later is told
            self._fenced[key] = (int(reason), now)
            self._fenced.move_to_end(key)
            while self._fenced and (len(self._fenced) > _MAX_FENCED
                                    or next(iter(self._fenced.values()))[1] < now - _FENCED_KEEP_S):
                self._fenced.popitem(last=False)
            conns = [c for c in self._conns if c.direct]
        if not conns:
            return
        with self._fence_cond:
            self._fence_seq += 1
            fence_id = self._fence_seq
            waiting = self._fencing[fence_id] = set(conns)
        msg = FENCE + _FENCE.pack(key, fence_id, int(reason))
        for conn in conns:
            conn.send(msg)
        end = time.monotonic() + self.fence_timeout
        with self._fence_cond:
            while waiting and not self._closed.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._fence_cond.wait(left)
            late = list(waiting)
            del self._fencing[fence_id]
        self._ledger.count("fences")
        for conn in late:
            self._ledger.count("fence_timeouts")
            logger.warning("a NIXL KV sender did not answer a fence within %.1f s for transfer %r: disconnected",
                           self.fence_timeout, transfer_id)
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def _on_fenced(self, conn: _RecvConn, frame: bytes) -> None:
        if len(frame) != len(FENCED) + _FENCE_ID.size:
            raise KVTransferError("bad FENCED message")
        (fence_id,) = _FENCE_ID.unpack_from(frame, len(FENCED))
        with self._fence_cond:
            waiting = self._fencing.get(fence_id)
            if waiting is not None:
                waiting.discard(conn)
                self._fence_cond.notify_all()

    # ---- ledger callbacks ------------------------------------------------------------

    def _ack(self, peers, key: int, nbytes: int) -> None:
        msg = WireHeader(MsgKind.ACK, transfer_key=key, num_bytes=nbytes, fingerprint=self.layout.fingerprint).pack()
        for conn in peers:
            conn.send(msg)

    def _nack(self, peers, key: int, reason: NackReason) -> None:
        msg = WireHeader(MsgKind.NACK, transfer_key=key, status=int(reason), fingerprint=self.layout.fingerprint).pack()
        for conn in peers:
            conn.send(msg)

    # ---- connections -----------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _RecvConn(sock)
            conn.thread = threading.Thread(target=self._serve, args=(conn,), name="kvtransfer-nixl-conn", daemon=True)
            with self._lock:
                self._conns.add(conn)
            conn.thread.start()

    def _serve(self, conn: _RecvConn) -> None:
        _bind_device(self._device)  # this thread registers its connection's memory and posts its READs
        # Landings copy (scatter, pull, dequantize) and wait on this thread's current stream: on the
        # engine's stream each one would wait behind the decode steps queued there.
        with _own_stream(self._device):
            self._serve_conn(conn)

    def _serve_conn(self, conn: _RecvConn) -> None:
        try:
            conn.sock.settimeout(self._connect_timeout)
            if not self._admit(conn):
                return
            hello = _recv_frame(conn.sock)
            conn.sock.settimeout(None)
            if hello is None or not self._handshake(conn, hello):
                return
            while not self._closed.is_set():
                frame = _recv_frame(conn.sock)
                if frame is None:
                    return
                if conn.direct and frame[:len(FENCED)] == FENCED:
                    self._on_fenced(conn, frame)
                    continue
                header = unpack_header(frame, expected_fingerprint=self.layout.fingerprint)
                if header.kind == MsgKind.BYE:
                    return
                expected = DIRECT if conn.direct else WRITTEN if conn.write else PULL
                if header.kind != MsgKind.LAYER or not header.status & expected:
                    raise KVTransferError(f"unexpected KV message {header.kind.name} on a NIXL connection")
                if conn.direct:
                    self._on_direct(conn, header, frame)
                elif conn.write:
                    self._on_written(conn, header, frame)
                else:
                    self._on_layer(conn, header, frame)
        except (KVTransferError, OSError, ValueError) as e:
            if not self._closed.is_set():
                self._ledger.count("protocol_errors")
                logger.warning("NIXL KV connection closed: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                if conn.write:
                    self._retired.append(conn)
            if conn.direct:  # a closed connection answers no fence: nothing waits for it
                with self._fence_cond:
                    for waiting in self._fencing.values():
                        waiting.discard(conn)
                    self._fence_cond.notify_all()
            agent = self._agent
            if agent is not None:
                if conn.staging_reg is not None and not conn.write:
                    agent.deregister_memory(conn.staging_reg)
                if conn.remote_agent is not None:
                    agent.remove_remote_agent(conn.remote_agent)
            conn.sock.close()

    def _admit(self, conn: _RecvConn) -> bool:
        """The interface and token checks, before the sender may say anything else."""
        local = conn.sock.getsockname()[0]
        if not auth.address_allowed(local, self._allowed):
            return self._refuse(conn, auth.REFUSED_REASONS[auth.REFUSED_INTERFACE])
        if self._token is None:
            conn.send(AUTH_NONE)
            return True
        server_nonce = auth.new_nonce()
        conn.send(AUTH_CHALLENGE + server_nonce)
        answer = _recv_frame(conn.sock)
        if answer is None or len(answer) != auth.NONCE_BYTES + auth.PROOF_BYTES:
            return self._refuse(conn, auth.REFUSED_REASONS[auth.REFUSED_TOKEN])
        client_nonce, proof = answer[:auth.NONCE_BYTES], answer[auth.NONCE_BYTES:]
        if not auth.verify(auth.sender_proof(self._token, server_nonce, client_nonce, _AUTH_FP), proof):
            return self._refuse(conn, auth.REFUSED_REASONS[auth.REFUSED_TOKEN])
        conn.send(AUTH_OK + auth.receiver_proof(self._token, server_nonce, client_nonce, _AUTH_FP))
        return True

    def _refuse(self, conn: _RecvConn, reason: str) -> bool:
        self._ledger.count("peers_refused")
        logger.warning("KV peer refused: %s", reason)
        conn.send(AUTH_REFUSED + reason.encode())
        return False

    def _handshake(self, conn: _RecvConn, hello: bytes) -> bool:
        header = unpack_header(hello, check_version=False)
        if header.kind != MsgKind.HELLO:
            raise KVTransferError(f"expected HELLO on a new KV connection, got {header.kind.name}")
        peer = unpack_layout(hello[HEADER_BYTES:HEADER_BYTES + LAYOUT_BYTES])
        problems = handshake_mismatches(self.layout, header, peer, self._model, hello_model(hello, header))
        if header.version == wire.WIRE_VERSION and header.layers not in (0, self.incarnation):
            problems.append("the receiver at this address restarted (another incarnation)")
        if problems:
            self._ledger.count("handshake_errors")
            logger.error("rejected a KV sender at handshake: KV peers do not match: %s", "; ".join(problems))
            conn.send(pack_hello(MsgKind.HELLO_REJECT, self.layout, model=self._model, incarnation=self.incarnation,
                                 extra="; ".join(problems).encode()))
            return False
        info = json.loads(hello_extra(hello, header))
        conn.remote_agent = self._agent.add_remote_agent(base64.b64decode(info["metadata"]))
        conn.pools = np.array(info["pools"], dtype=np.uint64).reshape(self.layout.num_layers, 2)
        conn.remote_dev = int(info["dev"])
        if info["mem"] != self._mem:
            logger.info("NIXL KV sender pools in %s, receiver pools in %s", info["mem"], self._mem)
        conn.remote_mem = info["mem"]
        if info.get("op") == "direct":
            with self._lock:
                if self._pool_reg is None:
                    self._pool_reg = _register(self._agent, self._pools, self._mem, self._dev)
                conn.direct = True  # from here on a fence includes it; the ones before, it is told now
                fenced = [[key, reason] for key, (reason, _) in self._fenced.items()]
            offer = json.dumps({
                "metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
                "pools": _pool_addresses(self._pools),
                "blocks": self._pools[0][0].shape[0], "dev": self._dev, "mem": self._mem, "fenced": fenced,
            }).encode()
            conn.send(pack_hello(MsgKind.HELLO_OK, self.layout, model=self._model, incarnation=self.incarnation,
                                 status=DIRECT, extra=offer))
            return True
        if info.get("op") == "write":
            slot_bytes, slots = _slot_config()
            slot_bytes = max(slot_bytes, 2 * self.layout.block_bytes)  # at least one block's K and V
            conn.write, conn.slot_bytes, conn.slots = True, slot_bytes, slots
            staging = self._staging(conn, slot_bytes * slots)
            offer = json.dumps({
                "metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
                "base": staging.data_ptr(), "slot_bytes": slot_bytes, "slots": slots,
                "dev": self._dev, "mem": self._mem,
            }).encode()
            conn.send(pack_hello(MsgKind.HELLO_OK, self.layout, model=self._model, incarnation=self.incarnation,
                                 extra=offer))
            return True
        conn.send(pack_hello(MsgKind.HELLO_OK, self.layout, model=self._model, incarnation=self.incarnation,
                             status=PULL))
        return True

    def _staging(self, conn: _RecvConn, nbytes: int) -> torch.Tensor:
        if conn.staging is None or conn.staging.numel() < nbytes:
            if conn.staging_reg is not None:
                self._agent.deregister_memory(conn.staging_reg)
            size = 1 << max(20, (nbytes - 1).bit_length())
            conn.staging = torch.empty(size, dtype=torch.uint8, device=self._device)
            conn.staging_reg = self._agent.register_memory([(conn.staging.data_ptr(), size, self._dev, "")], self._mem)
        return conn.staging

    def _on_layer(self, conn: _RecvConn, header: WireHeader, frame: bytes) -> None:
        n = header.num_blocks
        ids = np.frombuffer(frame, dtype=np.int32, count=2 * n, offset=HEADER_BYTES)
        dst, src = ids[:n].tolist(), ids[n:].tolist()
        key, layer = header.transfer_key, header.layer
        if self._ledger.check_message(key, layer, dst, conn) != NackReason.NONE:
            # dropped before anything is read: the ledger counts it and NACKs the sender
            self._ledger.land(key, layer, dst, torch.empty(0, device=self._device), conn)
            return
        if not 0 <= layer < self.layout.num_layers or not all(0 <= b < 2**31 for b in src):
            raise KVTransferError(f"bad LAYER message: layer {layer}, source ids {src[:8]}")
        block = self.layout.block_bytes
        staging = self._staging(conn, 2 * n * block)
        base = staging.data_ptr()
        local = np.empty((2 * n, 3), dtype=np.uint64)
        local[:, 0] = base + np.arange(2 * n, dtype=np.uint64) * block
        local[:, 1] = block
        local[:, 2] = self._dev
        remote = np.empty((2 * n, 3), dtype=np.uint64)
        src_off = np.asarray(src, dtype=np.uint64) * block
        remote[:n, 0] = conn.pools[layer, 0] + src_off
        remote[n:, 0] = conn.pools[layer, 1] + src_off
        remote[:, 1] = block
        remote[:, 2] = conn.remote_dev
        agent = self._agent
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, self._mem),
                                       agent.get_xfer_descs(remote, conn.remote_mem), conn.remote_agent)
        try:
            _wait_xfer(agent, handle, "READ")
        finally:
            handle.release()
        staged = staging[:2 * n * block].view(self.layout.torch_dtype).view(2, n, *self.layout.block_shape)
        self._ledger.count("messages_pulled")
        self._ledger.land(key, layer, dst, staged, conn)

    def _on_direct(self, conn: _RecvConn, header: WireHeader, frame: bytes) -> None:
        """LAYER (status DIRECT): the sender's WRITE of these blocks into ``header.layers`` layers
        from ``header.layer`` is DONE; check and record it (a drop is counted and NACKed)."""
        n = header.num_blocks
        if n < 1 or header.layers < 1 or len(frame) != HEADER_BYTES + 4 * n:
            raise KVTransferError(f"bad DIRECT message: {n} blocks, {header.layers} layers, {len(frame)} bytes")
        trace.mark("r.control", header.transfer_key, header.layer)
        dst = np.frombuffer(frame, dtype=np.int32, count=n, offset=HEADER_BYTES).tolist()
        self._ledger.land_many([(header.transfer_key, header.layer, dst, InPlace(header.layers), conn)])

    def _on_written(self, conn: _RecvConn, header: WireHeader, frame: bytes) -> None:
        """A LAYER the sender WROTE into slot ``slot`` of this connection's staging: land it (or
        drop it, NACKing), then hand the slot back."""
        n = header.num_blocks
        (slot,) = _SLOT.unpack_from(frame, HEADER_BYTES)
        fp8 = bool(header.status & FP8_WIRE)
        if fp8 and not self.layout.fp8_wire:
            raise KVTransferError(f"bad WRITTEN message: FP8 blocks for a {self.layout.dtype} KV layout")
        nbytes = self.layout.layer_message_bytes(n, "fp8" if fp8 else "full")
        crc_at = HEADER_BYTES + _SLOT.size + 4 * n
        need = crc_at + (CHECKSUM_BYTES if header.status & CHECKSUM else 0)
        if not 0 <= slot < conn.slots or not 0 < nbytes <= conn.slot_bytes or len(frame) < need:
            raise KVTransferError(f"bad WRITTEN message: slot {slot}, {n} blocks")
        dst = np.frombuffer(frame, dtype=np.int32, count=n, offset=HEADER_BYTES + _SLOT.size).tolist()
        key, layer = header.transfer_key, header.layer
        try:
            if self._ledger.check_message(key, layer, dst, conn) != NackReason.NONE:
                self._ledger.land(key, layer, dst, torch.empty(0, device=self._device), conn)  # counted, NACKed
                return
            if not 0 <= layer < self.layout.num_layers:
                raise KVTransferError(f"bad WRITTEN message: layer {layer}")
            start = slot * conn.slot_bytes
            raw = conn.staging[start:start + nbytes]
            if header.status & CHECKSUM and raw.device.type == "cpu":
                crc = int.from_bytes(frame[crc_at:crc_at + CHECKSUM_BYTES], "little")
                if payload_checksum(raw) != crc:  # the transfer fails; nothing of it lands
                    self._ledger.reject_corrupt(key, layer, conn)
                    return
            self._ledger.count("messages_written")
            if fp8:  # dequantized into the pools' dtype by the ledger, on landing
                rows = fp8_block_rows(self.layout.block_size, self.layout.head_dim)
                payload = FP8Payload(raw.view(1, 2, n, rows, *self.layout.block_shape[1:]))
                self._ledger.land_many([(key, layer, dst, payload, conn)])
            else:
                self._ledger.land(key, layer, dst,
                                  raw.view(self.layout.torch_dtype).view(2, n, *self.layout.block_shape), conn)
        finally:
            conn.send(CREDIT + _SLOT.pack(slot))
