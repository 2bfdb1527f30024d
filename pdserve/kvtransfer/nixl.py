"""NIXL backend (NVIDIA's inference transfer library, ``pip install 'pdserve[nixl]'``).

The same wire semantics as the UCX backend (``pdserve.kvtransfer.ucx``), with NIXL moving the bytes:

1. Control path: a TCP connection per sender and receiver, length-prefixed frames carrying
   the UCX backend's wire messages (``pdserve.kvtransfer.layout``). The sender sends HELLO (wire
   version, layout, model, and as transport data its NIXL agent's metadata and the addresses
   of its K and V pools); the receiver checks it like the UCX one (``handshake_errors``,
   HELLO_REJECT naming what differs) and answers HELLO_OK. The address,
   ``nixl://host:port/<incarnation>``, names the receiver's process: a receiver restarted at
   the same port refuses transfers meant for the old one.
2. DIRECT (``op="direct"``): the receiver registers its pools with its agent once
   and answers HELLO_OK (status DIRECT) with its agent's metadata and the pools' addresses. The
   sender WRITEs each message's source blocks straight into the reserved destination blocks: one
   NIXL descriptor per run of consecutive source blocks onto consecutive destination blocks, K
   and V, and every message queued at the time in one transfer (one handle, posted ahead of the
   previous one's DONE). Once NIXL says DONE it sends a LAYER (status DIRECT, ``layers``
   consecutive layers onto the same blocks): header and destination block ids. The receiver
   checks it against the transfer (a drop is counted and NACKed) and records the landing: there
   is no copy on the receiving side. Since the bytes are in the pool before the receiver sees
   the message, a dropped transfer (cancelled, expired, failed) is *fenced* before its blocks go
   back to the engine (``NixlReceiver.cancel`` and ``wait``): every DIRECT sender gets FENCE
   (the transfer's key and the reason); it drops what it has queued for that transfer, waits
   for everything it posted to be DONE and answers FENCED. A sender that does not answer
   within ``fence_timeout`` is disconnected; a sender that connects later is told the recent
   fences in HELLO_OK. What a DIRECT receiver trusts: that an authenticated sender writes only
   the destination ids it was given for a live transfer (the router's reservation); a sender
   given ids that were never reserved writes them before the NACK.
3. WRITE (``op="write"``, the default): the receiver answers HELLO_OK with its agent's metadata
   and a staging buffer of its own for this connection (``slots`` slots of ``slot_bytes``,
   registered once). Per ``send_layer`` the sender takes a free slot, gathers the layer's source
   blocks (K blocks, then V blocks) into its own mirror of that slot (one copy on the device),
   WRITEs it as one NIXL descriptor (a layer with more blocks than a slot holds goes in several
   messages) and, once NIXL says DONE, sends a LAYER message (status
   WRITTEN): header, the slot, the destination block ids. WRITEs are posted ahead, up to the free
   slots, and their LAYER messages go in order. The receiver checks it against the
   transfer it expects (unknown id, blocks not reserved, deadline passed: NACK), the ledger
   scatters the slot into the reserved blocks under the transfer's lock (so a cancel or an
   expired deadline still promises that nothing is written into the pools after it returns),
   and the receiver hands the slot back (a CREDIT frame). The sender only ever writes into its
   connection's staging, never into the pools: a late or stray WRITE can spoil nothing but a
   slot the receiver has not landed yet. A connection's staging is kept until the receiver
   closes (a dead or hung sender's WRITE may still be in flight).
4. READ (``op="read"``; what a receiver that does not offer staging gets): per ``send_layer`` the
   sender sends a LAYER message (status PULL): header, destination block ids, then source block
   ids; the receiver checks it, READs the source blocks from the sender's registered pools into
   a staging buffer and the ledger scatters them as above. On one H200 NIXL's READ ran at
   0.4-0.6 GB/s between two processes where its WRITE ran at 0.4-1.2 TB/s.

In both, the sender keeps its blocks until the ACK (the prefill worker releases them after
``finish``), and when a transfer has landed the receiver sends ACK to every sender that
contributed.

NIXL's agent runs its UCX progress thread (``enable_prog_thread``); the initiator (the sender of a
WRITE, the receiver of a READ) waits by polling ``check_xfer_state``, yielding the GIL between
polls. Transfer handles are
made per message from descriptor lists (``initialize_xfer``); memory is registered once per
pool and per staging size, never per message.

Descriptors are what a NIXL transfer costs on one GPU: its UCX plugin moves each descriptor as a
CUDA IPC copy of its own, about 9-15 us each on an H200, so the per-block descriptors of scattered
blocks (DIRECT) run at 2-4 GB/s, raw NIXL with the same descriptors included, where one descriptor
per layer runs at over 1 TB/s (docs/results.md).

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

Every mode is slower on a GPU than the UCX backend, which gathers with one kernel (one H200, 2k
tokens of scattered Llama-3.1-8B KV: 21 ms by WRITE, 98 ms by DIRECT, 3.8 s by READ, 1.8 ms on the
UCX backend): a sender on CUDA pools logs a warning once.

Environment: ``PDSERVE_NIXL_SLOT_BYTES`` (default 16 MiB) and ``PDSERVE_NIXL_SLOTS`` (default 4),
the receiver's staging per WRITE connection.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import importlib
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
import uuid
from typing import Sequence

import numpy as np
import torch

from pdserve.kvtransfer import auth, trace
from pdserve.kvtransfer import layout as wire
from pdserve.kvtransfer.base import KVCaches, KVSender, TransferResult, env_positive_int, wire_fp8
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kernels.kv_codec import pack_blocks
from pdserve.kernels.kv_quant import fp8_block_rows
from pdserve.kvtransfer.faults import FaultInjector
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
    check_handshake,
    handshake_mismatches,
    hello_extra,
    hello_model,
    pack_hello,
    payload_checksum,
    transfer_key,
    unpack_header,
    unpack_layout,
)
from pdserve.kvtransfer.ledger import FP8Payload, InPlace, LedgerReceiver, ReceiveLedger, SendLedger
from pdserve.kvtransfer.pacing import LinkHolds, LinkPacer
from pdserve.kvtransfer.staging import block_index

logger = logging.getLogger(__name__)

SCHEME = "nixl://"
_FRAME = struct.Struct("<I")
CREDIT = b"PDKVC"  # receiver -> sender frame: CREDIT + u32 slot, the slot is free again (WRITE)
_SLOT = struct.Struct("<I")
# DIRECT: receiver -> sender FENCE + u64 transfer key + u64 fence id + u32 NackReason (write nothing
# more for that transfer; answer once what is posted is DONE); sender -> receiver FENCED + u64 fence id
FENCE, FENCED = b"PDKVF", b"PDKVG"
_FENCE = struct.Struct("<QQI")
_FENCE_ID = struct.Struct("<Q")
FENCE_TIMEOUT_S = 5.0
_MAX_FENCED, _FENCED_KEEP_S = 65536, 300.0  # fences a DIRECT sender is told at handshake
_MAX_BATCH = 256  # queued messages a DIRECT sender gathers into one WRITE
_WAKE = ("wake",)  # a _Link.queue item: a FENCE came (the sending thread serves it)
OPS = ("direct", "write", "read")
_MAX_FRAME = 64 << 20


def load_nixl():
    """NIXL's Python API module (``nixl_agent``, ``nixl_agent_config``); KVTransferError naming
    what failed when it cannot be imported. The ``nixl`` meta package picks its CUDA flavour from
    the CUDA stack already imported (cuda-bindings 12 picks nixl-cu12); the flavour wheels
    ``nixl_cu13`` and ``nixl_cu12`` are tried directly after it."""
    errors = []
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise KVTransferError("NIXL is not importable (pip install 'pdserve[nixl]'): " + "; ".join(errors))


def _agent(api, role: str, progress_thread: bool = True):
    """A NIXL agent with the UCX plugin; ``progress_thread``: NIXL's own thread progresses UCX
    (it busy-polls: on a host of few cores it competes with the caller, who otherwise progresses
    UCX by checking its transfers' state)."""
    name = f"pdserve-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


_CUDA_WARNED = threading.Event()


def _warn_on_cuda(device: torch.device, op: str) -> None:
    """Once per process: this backend on CUDA pools is far slower than the UCX backend."""
    if device.type == "cuda" and not _CUDA_WARNED.is_set():
        _CUDA_WARNED.set()
        took = {"write": "21 ms (WRITE)", "direct": "98 ms (DIRECT)"}.get(op, "3.8 s (READ)")
        logger.warning("the NIXL KV backend is slow on GPUs: on one H200 a 2k-token Llama-3.1-8B KV took %s, "
                       "against 1.8 ms on the UCX backend; use --kv-backend ucx there (docs/results.md)", took)


def _slot_config() -> tuple[int, int]:
    """(slot bytes, slots) of a WRITE connection's staging, from the environment."""
    return (env_positive_int("PDSERVE_NIXL_SLOT_BYTES", 16 << 20, KVTransferError),
            env_positive_int("PDSERVE_NIXL_SLOTS", 4, KVTransferError))


def _mem(device: torch.device) -> tuple[str, int]:
    """NIXL memory type and device id of tensors on ``device``."""
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    if device.type != "cpu":
        raise ValueError(f"the NIXL backend moves CPU or CUDA pools, not {device.type}")
    return "DRAM", 0


def _pools(kv_caches: KVCaches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pools = [(k, v) for k, v in kv_caches]
    if not pools:
        raise ValueError("kv_caches is empty")
    for k, v in pools:
        if not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError("the NIXL backend needs contiguous K and V pools")
    return pools


def _pool_addresses(pools) -> list[list[int]]:
    """[layer][K, V] base addresses of ``pools``, as a handshake offers them."""
    return [[k.data_ptr(), v.data_ptr()] for k, v in pools]


def _register(agent, pools, mem: str, dev: int):
    """Register every distinct allocation under ``pools`` once (pools that are views of one
    allocation share it); returns the registration descriptor list."""
    regions = {}
    for pair in pools:
        for t in pair:
            storage = t.untyped_storage()
            regions[storage.data_ptr()] = storage.nbytes()
    return agent.register_memory([(ptr, n, dev, "") for ptr, n in sorted(regions.items())], mem)


def _send_frame(sock: socket.socket, lock: threading.Lock, data: bytes) -> None:
    with lock:
        sock.sendall(_FRAME.pack(len(data)) + data)


def _send_frames(sock: socket.socket, lock: threading.Lock, frames: Sequence[bytes]) -> None:
    """Several frames in one ``sendall``."""
    if frames:
        with lock:
            sock.sendall(b"".join(_FRAME.pack(len(f)) + f for f in frames))


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes | None:
    head = _recv_exact(sock, _FRAME.size)
    if head is None:
        return None
    (n,) = _FRAME.unpack(head)
    if n > _MAX_FRAME:
        raise KVTransferError(f"KV control frame of {n} bytes (at most {_MAX_FRAME})")
    return _recv_exact(sock, n)


def parse_address(address: str) -> tuple[str, int, int]:
    """``nixl://host:port/<incarnation hex>`` -> (host, port, incarnation)."""
    if not isinstance(address, str) or not address.startswith(SCHEME):
        raise ValueError(f"not a NIXL KV address: {address!r}")
    rest = address[len(SCHEME):]
    hostport, _, inc = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    try:
        return host.strip("[]"), int(port), int(inc or "0", 16)
    except ValueError:
        raise ValueError(f"not a NIXL KV address: {address!r}") from None


def _descs(parts: list[tuple[np.ndarray, np.ndarray]], dev: int) -> np.ndarray:
    """NIXL descriptors ``[n, 3]`` (address, bytes, device) from (addresses, sizes) pairs."""
    out = np.empty((sum(a.size for a, _ in parts), 3), dtype=np.uint64)
    at = 0
    for addrs, sizes in parts:
        out[at:at + addrs.size, 0] = addrs
        out[at:at + addrs.size, 1] = sizes
        at += addrs.size
    out[:, 2] = dev
    return out


def _bind_device(device: torch.device) -> None:
    """Make ``device``'s CUDA context current in the calling thread, which registers memory or posts
    NIXL transfers (UCX's CUDA transports work through the thread's current context).
    ``set_device`` alone does not bind it (torch skips it when the device number is already the
    thread's); a runtime call does."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.current_stream(device).query()


def _own_stream(device: torch.device):
    """A context that makes a new stream of ``device`` the calling thread's current one (CUDA;
    nothing elsewhere)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))


def _wait_xfer(agent, handle, what: str, state: str | None = None) -> None:
    """Post ``handle`` (or, given the ``state`` its post returned, only wait) until NIXL says DONE."""
    if state is None:
        state = agent.transfer(handle)
    while state == "PROC":
        time.sleep(0)  # yield the GIL; NIXL's progress thread moves the bytes
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise KVTransferError(f"NIXL {what} failed (state {state})")


# The control connection's first exchange, before HELLO: the cluster token proved by challenge
# and response (kvtransfer.auth; the token never crosses the wire). The receiver opens with
# AUTH_NONE (no token) or AUTH_CHALLENGE + its nonce; a sender with the token answers its nonce
# and proof, and the receiver answers AUTH_OK + its own proof or AUTH_REFUSED + the reason.
AUTH_NONE, AUTH_CHALLENGE, AUTH_OK, AUTH_REFUSED = b"PDKV0", b"PDKV1", b"PDKVY", b"PDKVN"
_AUTH_FP = 0  # the proof binds the nonces only: the layouts are compared at HELLO, after it


def _refused(address: str, reason: str) -> KVTransferError:
    return KVTransferError(f"KV peer refused: {reason} (receiver {address})")


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
                self._ledger.land(key, layer, dst, raw.view(self.layout.torch_dtype).view(2, n, *self.layout.block_shape), conn)
        finally:
            conn.send(CREDIT + _SLOT.pack(slot))


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


class NixlSender(KVSender):
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
                    _send_frame(link.sock, link.lock, WireHeader(MsgKind.BYE, fingerprint=self.layout.fingerprint).pack())
                except OSError:
                    pass
                try:
                    link.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                link.sock.close()
