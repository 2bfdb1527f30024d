"""UCX backend over ``ucxx`` (asyncio API), usable from any thread.

One process-wide runtime owns the ucxx context and an asyncio event loop in a daemon
thread; senders and receivers share it (reference counted) and block on it through
``asyncio.run_coroutine_threadsafe``. UCX picks the transport (``UCX_TLS`` unset): TCP
and shared memory (posix, sysv, cma) on a CPU host; cuda_ipc / cuda_copy / RDMA where
present.

Per connection (sender -> receiver):

1. Control path: the sender connects to the receiver's listener (``ucx://host:port``,
   UCX endpoint error handling on, so a dead peer is detected). It sends HELLO (wire
   version + layout); the receiver answers HELLO_OK or HELLO_REJECT and closes. Before
   that, the receiver refuses a connection that did not arrive on the address it serves
   (``interface``), and, when it holds the cluster token (``token``), challenges the sender to
   prove it holds it too (``pdserve.kvtransfer.auth``): a refused sender gets HELLO_REJECT with the
   reason, nothing is reserved or mapped for it and its endpoint is closed. A
   mismatch raises KVTransferError on the sender (its transfers to that address
   fail) and is logged and counted (``handshake_errors``) on the receiver. HELLO_OK
   carries the receiver's UCX worker address and a per-connection tag.
2. Data path: the sender opens a second endpoint from that worker address, without
   endpoint error handling: UCX only offers its shared-memory transports (posix,
   sysv, cma) and CUDA IPC to endpoints without peer-failure handling, and these are
   what make same-host transfers fast. Per message: a control message (header + int32
   destination block ids) then the payload (K then V of the blocks of one or more
   consecutive layers, gathered into one staging buffer), tagged with the connection's
   tag and posted back to back so the receiver matches them in order. Consecutive
   layers of one transfer's chunk are coalesced into one message up to
   ``coalesce_bytes`` (default 64 MiB for CUDA pools, where a message costs far more in
   fixed overhead than in bytes; 0, one layer per message, for host pools, where the link
   is slow next to compute and each layer should leave as soon as it is computed); a
   paced link coalesces at most what it moves in 2 ms. A group is sent when it is full
   or at the chunk's last layer, so the layers of a chunk overlap the next chunk's compute. Up to ``max_inflight`` messages are in
   flight per connection; ``pacer`` delays them to an emulated link rate, counting
   each message ready from its ``send_layer`` (the sender loop's own time between
   messages is then not lost to the bucket: that is what holds 50-100 Gbit/s). On close
   the sender sends BYE on the data path.
3. The receiver keeps receives posted ahead: as soon as a control message is parsed it
   posts the payload's receive into a free staging slot (one of ``PDSERVE_KV_RECV_SLOTS``,
   default 8, per connection; CUDA memory for CUDA caches) and then the next control
   receive, so several payloads are on the wire at once. A landing thread scatters each
   payload into the reserved blocks on a CUDA stream of its own (never on the event loop,
   never behind the engine's kernels) and frees its slot; when a transfer has fully landed
   it sends ACK (on the control path) to every sender that contributed, NACK when it
   drops one (deadline, cancel, bad message, unknown id). Failure of a peer is seen
   on the control path, which then tears down the data path.
4. Pull path (same host, CUDA pools that are one allocation, ``pull=True``, no pacer on the
   link): HELLO carries the sender's pool descriptor (``pdserve.kvtransfer.ipc``); a receiver that
   maps it answers HELLO_OK with status PULL. From then on a message is the control message
   alone (header with status PULL, destination ids, then source ids; up to 256 MiB of KV per
   message, after the layers are computed), and the landing thread copies those blocks from
   the sender's pools into the reserved ones in one kernel (reads over NVLink), then ACKs as
   above. The sender keeps its blocks until the ACK (the prefill worker releases them after
   ``finish``). The link's first transfer, sent before the handshake ends, takes the staged
   path.

The loop thread shares the GIL with the engine thread of a worker; a thread waiting for
the GIL waits up to ``sys.getswitchinterval()`` (5 ms by default) each time, several times
per message. The runtime lowers it to ``PDSERVE_GIL_SWITCH_INTERVAL_S`` (default 0.2 ms):
under a busy engine that is the difference between a transfer of milliseconds and one of
hundreds.

ucxx runs with ``enable_python_future=True`` (its notifier thread completes asyncio
futures): the default polling mode spins the event loop at 100% CPU whenever a receive
is posted, i.e. always on an idle receiver.

Environment variables: see ``pdserve.kvtransfer.ucx_runtime``.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import functools
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pdserve.kernels.kv_codec import pack_blocks
from pdserve.kernels.kv_quant import fp8_block_rows
from pdserve.kvtransfer.base import KVCaches, KVSender, TransferResult, env_positive_int, wire_fp8
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.layout import (
    BLOCK_ID_BYTES,
    FP8_WIRE,
    HEADER_BYTES,
    HELLO_AUTH,
    LAYOUT_BYTES,
    MAX_BLOCKS_PER_MESSAGE,
    MAX_MODEL_NAME_BYTES,
    CHECKSUM,
    CHECKSUM_BYTES,
    payload_checksum,
    PULL,
    KVLayout,
    MsgKind,
    NackReason,
    WireHeader,
    check_handshake,
    hello_extra,
    hello_model,
    pack_hello,
    transfer_key,
    unpack_header,
    unpack_layout,
)
from pdserve.kvtransfer.auth import (
    NONCE_BYTES,
    PROOF_BYTES,
    REFUSED_INTERFACE,
    REFUSED_REASONS,
    REFUSED_TOKEN,
    address_allowed,
    allowed_addresses,
    new_nonce,
    receiver_proof,
    sender_proof,
    verify,
)
from pdserve.kvtransfer import trace
from pdserve.kvtransfer.faults import FaultInjector, FaultSpec
from pdserve.kvtransfer.ipc import MAX_DESCRIPTOR_BYTES, export_pools, import_pools
from pdserve.kvtransfer.ledger import LedgerReceiver, FP8Payload, PullSource, ReceiveLedger, SendLedger
from pdserve.kvtransfer.pacing import LinkHolds, LinkPacer
from pdserve.kvtransfer.staging import (
    HostBuffers, block_index, gather_layer, gather_layers, ready_prefix, stacked_pools, wire_buffer,
)
from pdserve.kvtransfer.ucx_runtime import (
    SCHEME,
    TaskSet,
    UcxRuntime,
    abort_endpoint,
    address_incarnation,
    endpoint_sockaddrs,
    parse_address,
)

logger = logging.getLogger(__name__)

def _abort_link(link) -> None:
    for ep in (link.data_ep, link.ep):
        if ep is not None:
            abort_endpoint(ep)


_MAX_WORKER_ADDRESS = 64 * 1024
_PULL_BYTES = 256 << 20  # most KV bytes per pulled message (UcxSender._open_group)


def _check_token(token) -> None:
    if token is not None and (not isinstance(token, str) or not token):
        raise ValueError("the KV plane's token must be a non-empty str (the cluster token) or None")


def _recv_slots() -> int:
    return env_positive_int("PDSERVE_KV_RECV_SLOTS", 8)


# ---------------------------------------------------------------------------------------
# receiver


class _Conn:
    """One sender's connection as the receiver sees it (also the ledger's peer handle)."""

    def __init__(self, ep):
        self.ep = ep
        self.task: asyncio.Task | None = None
        self.open = True
        self.remote: torch.Tensor | None = None  # the sender's stacked pools, mapped (pull path)


class _Slot:
    """A staging buffer that one payload is received into, grown on demand."""

    def __init__(self, device: torch.device):
        self._device = device
        self._buffer: torch.Tensor | None = None

    def view(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return self._buffer[:nbytes]


class _Lander:
    """The receiver's thread that scatters received payloads into the pools, on a CUDA stream
    of its own: it takes every payload queued so far, scatters them all and waits once
    (``ledger.land_many``), then runs each item's ``done`` (which frees its staging slot)."""

    def __init__(self, ledger: ReceiveLedger, device: torch.device):
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(ledger, device), daemon=True,
                                        name="kvtransfer-landing")
        self._thread.start()

    def put(self, items: list[tuple[int, int, list[int], torch.Tensor | PullSource, _Conn]], done=None) -> None:
        """``items``: ``(key, first_layer, dst_ids, staged [layers, 2, n, ...] or a PullSource, conn)``
        of one received message; ``done`` (if any) runs after they landed."""
        self._todo.put((items, done))

    def close(self) -> None:
        self._todo.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _run(self, ledger: ReceiveLedger, device: torch.device) -> None:
        context = contextlib.nullcontext()
        if device.type == "cuda":
            if device.index is None:  # a bare "cuda": the current device (set_device needs an index)
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            context = torch.cuda.stream(torch.cuda.Stream(device))
        closing = False
        with context:
            while not closing:
                batch = [self._todo.get()]
                while not self._todo.empty() and len(batch) < 64:  # what arrived meanwhile: one wait for all
                    batch.append(self._todo.get())
                if None in batch:
                    closing = True
                    batch = batch[:batch.index(None)]
                if trace.ENABLED:
                    for items, _ in batch:
                        for item in items:
                            trace.mark("r.lander", item[0], item[1])
                try:
                    ledger.land_many([item for items, _ in batch for item in items])
                except Exception as e:  # a failed scatter fails the transfer, not the thread
                    logger.error("landing KV payloads failed: %s: %s", type(e).__name__, e)
                finally:
                    for _, done in batch:
                        if done is not None:
                            done()


class UcxReceiver(LedgerReceiver):
    """Options: ``host`` (advertised in ``address()``, default 127.0.0.1), ``port`` (0:
    ephemeral), ``connect_timeout``, ``model`` (the model's name: a sender that states another
    is refused at handshake), ``token`` (the cluster token: a sender that cannot prove it holds
    it is refused; None: no check), ``interface`` (the local address connections must arrive on;
    None: ``host``; ``"any"``: every interface). The ucxx listener itself binds every interface
    (its Python API takes no address), so a connection that arrived on another local address is
    refused after UCX accepted it, before the handshake (``pdserve.kvtransfer.auth``).

    ``address()`` ends in ``#<incarnation>``, a random id of this receiver: a sender that
    connects to the same host and port but finds another incarnation there (the process
    restarted) fails the transfers meant for the old one instead of landing them in the new."""

    def __init__(self, kv_caches: KVCaches, host: str = "127.0.0.1", port: int = 0, connect_timeout: float = 5.0,
                 model: str = "", token: str | None = None, interface: str | None = None):
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in [0, 65536), got {port!r}")
        _check_token(token)
        self.layout = KVLayout.from_caches(kv_caches)
        self._model = model
        self._token = token
        self._allowed = allowed_addresses(host, interface)
        self.incarnation = int.from_bytes(os.urandom(4), "little") or 1
        self._caches = kv_caches
        self._device = kv_caches[0][0].device
        self._host = host
        self._connect_timeout = connect_timeout
        self._ledger = ReceiveLedger(kv_caches, self.layout, on_ack=self._on_ack, on_nack=self._on_nack)
        self._slots = _recv_slots()
        self._lander = _Lander(self._ledger, self._device)
        self._conns: set[_Conn] = set()
        self._tasks = TaskSet()
        self._closed = False
        self._close_lock = threading.Lock()
        self._rt = UcxRuntime.acquire(host_memory=self._device.type != "cuda")
        try:
            self._listener = self._listen_retrying(port)
        except BaseException:
            self._lander.close()
            UcxRuntime.release()
            raise
        self._address = (f"{SCHEME}{'[' + host + ']' if ':' in host else host}:{self._listener.port}"
                         f"#{self.incarnation:08x}")
        _LIVE.add(self)

    def _listen_retrying(self, port: int, wait_s: float = 90.0):
        """The listener on ``port``; a fixed port still held by the connections of a process that
        died there (TIME_WAIT, up to a minute: a restart at the same address) is retried."""
        deadline = time.monotonic() + (wait_s if port else 0.0)
        while True:
            try:
                return self._rt.call(self._listen(port))
            except Exception as e:
                if "Busy" not in type(e).__name__ or time.monotonic() > deadline:
                    raise
                logger.warning("KV port %d is still held (%s); retrying", port, e)
                time.sleep(1.0)

    def metrics(self) -> dict[str, float]:
        out = self._ledger.snapshot()
        out["connections"] = float(len(self._conns))
        return out

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        _LIVE.discard(self)
        self._ledger.close()
        try:
            self._rt.call(self._shutdown())
        finally:
            self._lander.close()
            UcxRuntime.release()

    # ---- on the loop -------------------------------------------------------------------

    async def _listen(self, port: int):
        return self._rt.ucxx.create_listener(self._serve, port=port, connect_timeout=self._connect_timeout)

    async def _shutdown(self) -> None:
        self._listener.close()
        conns = list(self._conns)
        for conn in conns:
            conn.open = False
            abort_endpoint(conn.ep)
        tasks = [c.task for c in conns if c.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._tasks.cancel_all()
        self._conns.clear()

    async def _serve(self, ep) -> None:
        """Listener callback: serve one sender connection until it closes."""
        conn = _Conn(ep)
        conn.task = asyncio.current_task()
        if self._closed:
            abort_endpoint(ep)
            return
        self._conns.add(conn)
        # LAYER: header + destination ids (+ source ids on the pull path); HELLO: + layout + pool descriptor
        control = np.empty(HEADER_BYTES + 2 * MAX_BLOCKS_PER_MESSAGE * BLOCK_ID_BYTES, dtype=np.uint8)
        data = watch = None
        try:
            tag = await self._handshake(conn, control)
            if tag is not None:
                loop = asyncio.get_running_loop()
                data = loop.create_task(self._receive_data(conn, control, tag))
                # the sender sends nothing more on the control path: this receive ends
                # when the sender closes or dies
                watch = loop.create_task(ep.recv(np.empty(HEADER_BYTES, dtype=np.uint8)))
                await asyncio.wait({data, watch}, return_when=asyncio.FIRST_COMPLETED)
                if data.done():
                    data.result()  # raises a protocol error
        except asyncio.CancelledError:
            pass
        except KVTransferError as e:
            self._ledger.count("protocol_errors")
            logger.error("closing KV connection after a protocol error: %s", e)
        except Exception as e:  # the sender closed or died: normal end of a connection
            logger.debug("KV connection ended: %s: %s", type(e).__name__, e)
        finally:
            conn.open = False
            conn.remote = None  # unmap the sender's pools (a landing in progress holds its own reference)
            self._conns.discard(conn)
            abort_endpoint(ep)
            for task in (data, watch):
                if task is not None and not task.done():
                    # a worker-level receive of a vanished sender stays posted until
                    # the runtime shuts down; its buffer stays referenced by ucxx
                    task.cancel()
            await asyncio.gather(*(t for t in (data, watch) if t is not None), return_exceptions=True)

    async def _handshake(self, conn: _Conn, control: np.ndarray) -> int | None:
        """Answer HELLO; returns the data-path tag, or None after a refusal or a reject. Nothing
        is reserved, mapped or revealed (worker address, tag) before the interface and the
        token checks pass."""
        await asyncio.wait_for(conn.ep.recv(control), self._connect_timeout)
        header = unpack_header(control, check_version=False)
        if header.kind != MsgKind.HELLO:
            raise KVTransferError(f"expected HELLO on a new KV connection, got {header.kind.name}")
        if self._allowed is not None:
            local, remote = endpoint_sockaddrs(conn.ep)
            if not address_allowed(local, self._allowed):
                return await self._refuse(conn, REFUSED_INTERFACE, f"a connection from {remote} arrived on {local}, "
                                          f"this KV plane serves only {', '.join(sorted(self._allowed))}")
        hello = control
        proof = b""
        if self._token is not None:
            if not header.status & HELLO_AUTH:
                return await self._refuse(conn, REFUSED_TOKEN, "the sender holds no cluster token")
            hello = control.copy()  # `control` receives AUTH next
            proof = await self._challenge(conn, control, header.fingerprint)
            if proof is None:
                return None
        try:
            check_handshake(self.layout, header, unpack_layout(hello[HEADER_BYTES:HEADER_BYTES + LAYOUT_BYTES]),
                            self._model, hello_model(hello, header))
        except KVTransferError as e:
            self._ledger.count("handshake_errors")
            logger.error("rejected a KV sender at handshake: %s", e)
            reject = pack_hello(MsgKind.HELLO_REJECT, self.layout, model=self._model, incarnation=self.incarnation)
            await conn.ep.send(np.frombuffer(reject, dtype=np.uint8))
            await asyncio.sleep(0.05)  # let the reject reach the sender before we close
            return None
        tag = int.from_bytes(os.urandom(8), "little")
        status = 0
        if 0 < header.num_bytes <= MAX_DESCRIPTOR_BYTES:
            conn.remote, how = import_pools(hello_extra(hello, header), self._ledger.stacked)
            if conn.remote is not None:
                status = PULL
                self._ledger.count("pull_links")
            logger.info("KV sender %s: %s", "pull path" if status else "staged path", how)
        hello = pack_hello(MsgKind.HELLO_OK, self.layout, extra=proof + self._rt.worker_address, tag=tag,
                           status=status, model=self._model, incarnation=self.incarnation)
        await conn.ep.send(np.frombuffer(hello, dtype=np.uint8))
        return tag

    async def _challenge(self, conn: _Conn, control: np.ndarray, fingerprint: int) -> bytes | None:
        """CHALLENGE the sender and check its AUTH; returns this receiver's proof for HELLO_OK,
        or None after refusing the sender."""
        server_nonce = new_nonce()
        challenge = WireHeader(MsgKind.CHALLENGE, num_bytes=NONCE_BYTES, fingerprint=self.layout.fingerprint).pack()
        await conn.ep.send(np.frombuffer(challenge + server_nonce, dtype=np.uint8))
        try:
            await asyncio.wait_for(conn.ep.recv(control), self._connect_timeout)
            answer = unpack_header(control, check_version=False)
        except Exception as e:  # the sender hung up (it holds no token) or sent garbage
            return await self._refuse(conn, REFUSED_TOKEN, f"the sender did not answer the challenge "
                                      f"({type(e).__name__}: {e})", reply=False)
        start = HEADER_BYTES
        if answer.kind != MsgKind.AUTH or answer.num_bytes != NONCE_BYTES + PROOF_BYTES:
            return await self._refuse(conn, REFUSED_TOKEN, f"the sender answered the challenge with "
                                      f"{answer.kind.name} of {answer.num_bytes} bytes")
        client_nonce = control[start:start + NONCE_BYTES].tobytes()
        given = control[start + NONCE_BYTES:start + NONCE_BYTES + PROOF_BYTES].tobytes()
        if not verify(sender_proof(self._token, server_nonce, client_nonce, fingerprint), given):
            return await self._refuse(conn, REFUSED_TOKEN, "the sender's proof does not match this cluster's token")
        return receiver_proof(self._token, server_nonce, client_nonce, fingerprint)

    async def _refuse(self, conn: _Conn, reason: int, detail: str, reply: bool = True) -> None:
        """Refuse a sender before the handshake: count and log it, tell it why (HELLO_REJECT with
        the reason in ``status``) and return None (the caller closes the endpoint)."""
        self._ledger.count("peers_refused")
        logger.error("KV peer refused: %s: %s", REFUSED_REASONS[reason], detail)
        if reply:
            reject = pack_hello(MsgKind.HELLO_REJECT, self.layout, status=reason)
            try:
                await asyncio.wait_for(conn.ep.send(np.frombuffer(reject, dtype=np.uint8)), self._connect_timeout)
                await asyncio.sleep(0.05)  # let the reject reach the sender before we close
            except Exception as e:
                logger.debug("could not tell a refused KV peer why: %s", e)
        return None

    async def _receive_data(self, conn: _Conn, control: np.ndarray, tag: int) -> None:
        """Receive this connection's LAYER messages, keeping payload receives posted ahead.

        UCX matches receives of one tag in the order they were posted, and the sender posts
        control, payload, control, payload...: so each receive is a task created in that
        order (a task posts its receive at its first step, and tasks start in creation
        order), the payload's before the next control's."""
        recv = self._rt.ucxx.recv  # worker-level receive, matched by the connection's tag
        loop = asyncio.get_running_loop()
        free: asyncio.Queue[_Slot] = asyncio.Queue()
        for _ in range(self._slots):
            free.put_nowait(_Slot(self._device))
        payloads: set[asyncio.Task] = set()
        pending_control = loop.create_task(recv(control, tag))
        try:
            while True:
                await pending_control
                header = unpack_header(control, expected_fingerprint=self.layout.fingerprint)
                if header.kind == MsgKind.BYE:
                    pending_control = None
                    return
                if header.kind != MsgKind.LAYER:
                    raise KVTransferError(f"expected a LAYER message, got {header.kind.name}")
                n, layers = header.num_blocks, header.layers
                precision = "fp8" if header.status & FP8_WIRE and self.layout.fp8_wire else "full"
                if (not 0 < n <= MAX_BLOCKS_PER_MESSAGE or not 0 < layers <= self.layout.num_layers
                        or header.num_bytes != layers * self.layout.layer_message_bytes(n, precision)):
                    raise KVTransferError(f"LAYER header with {n} blocks, {layers} layers and {header.num_bytes} "
                                          "bytes is inconsistent")
                dst_ids = control[HEADER_BYTES:HEADER_BYTES + n * BLOCK_ID_BYTES].view("<i4").tolist()
                trace.mark("r.control", header.transfer_key, header.layer)
                if header.status == PULL:
                    if conn.remote is None:
                        raise KVTransferError("a pull LAYER message on a link without mapped pools")
                    src_ids = control[HEADER_BYTES + n * BLOCK_ID_BYTES:HEADER_BYTES + 2 * n * BLOCK_ID_BYTES]
                    source = PullSource(conn.remote, src_ids.view("<i4").tolist(), layers)
                    self._lander.put([(header.transfer_key, header.layer, dst_ids, source, conn)])
                    pending_control = loop.create_task(recv(control, tag))
                    continue
                crc = None
                if header.status & CHECKSUM:
                    at = HEADER_BYTES + n * BLOCK_ID_BYTES
                    crc = int.from_bytes(control[at:at + CHECKSUM_BYTES].tobytes(), "little")
                slot = await free.get()
                raw = slot.view(header.num_bytes)
                # always drained, even when the transfer is gone
                payload = loop.create_task(recv(wire_buffer(raw), tag))
                payloads.add(payload)
                payload.add_done_callback(functools.partial(
                    self._payload_received, payloads, free, slot, conn, header, dst_ids, raw, crc))
                pending_control = loop.create_task(recv(control, tag))
        finally:
            for task in (pending_control, *payloads):
                if task is not None and not task.done():
                    task.cancel()

    def _payload_received(self, payloads: set, free: asyncio.Queue, slot: _Slot, conn: _Conn,
                          header: WireHeader, dst_ids: list[int], raw: torch.Tensor, crc: int | None,
                          task: asyncio.Task) -> None:
        payloads.discard(task)
        if task.cancelled() or task.exception() is not None:
            return  # the connection is going away; its slots with it
        loop = asyncio.get_running_loop()

        def done() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to free
                loop.call_soon_threadsafe(free.put_nowait, slot)

        if crc is not None and raw.device.type == "cpu" and payload_checksum(raw) != crc:
            self._ledger.reject_corrupt(header.transfer_key, header.layer, conn)
            done()
            return

        if header.status & FP8_WIRE and self.layout.fp8_wire:  # dequantized by the lander, on landing
            rows = fp8_block_rows(self.layout.block_size, self.layout.head_dim)
            staged = FP8Payload(raw.view(header.layers, 2, header.num_blocks, rows, *self.layout.block_shape[1:]))
        else:
            staged = raw.view(self.layout.torch_dtype).view(header.layers, 2, header.num_blocks,
                                                            *self.layout.block_shape)
        self._lander.put([(header.transfer_key, header.layer, dst_ids, staged, conn)], done)

    # ---- ledger callbacks (any thread) -------------------------------------------------

    def _on_ack(self, peers: set, key: int, nbytes: int) -> None:
        trace.mark("r.ack", key)
        self._reply(peers, WireHeader(MsgKind.ACK, key, num_bytes=nbytes, fingerprint=self.layout.fingerprint))

    def _on_nack(self, peers: set, key: int, reason: NackReason) -> None:
        self._reply(peers, WireHeader(MsgKind.NACK, key, fingerprint=self.layout.fingerprint, status=int(reason)))

    def _reply(self, peers: set, header: WireHeader) -> None:
        payload = np.frombuffer(header.pack(), dtype=np.uint8)
        for conn in peers:
            if conn.open and not self._closed:
                self._rt.call_soon(self._spawn_reply, conn, payload)

    def _spawn_reply(self, conn: _Conn, payload: np.ndarray) -> None:
        if conn.open:
            self._tasks.spawn(self._send_reply(conn, payload))

    async def _send_reply(self, conn: _Conn, payload: np.ndarray) -> None:
        key = unpack_header(payload).transfer_key if trace.ENABLED else 0
        trace.mark("r.reply", key)
        try:
            await conn.ep.send(payload)
            trace.mark("r.replied", key)
        except Exception as e:
            logger.debug("could not send ACK/NACK: %s", e)


# ---------------------------------------------------------------------------------------
# sender


@dataclass
class _Message:
    key: int
    control: np.ndarray  # header + int32 dst ids (+ int32 src ids when pulled)
    payload: torch.Tensor | None  # flat uint8 staging buffer; None: the receiver pulls the blocks
    payload_bytes: int  # KV bytes the message moves
    ready: torch.cuda.Event | None  # gather (or, pulled, the layers' compute) finished (CUDA); the waiter clears it
    ready_at: float = 0.0  # pacer clock when the payload was ready (0 when unpaced)
    buffer: torch.Tensor | None = None  # the whole staging buffer the payload is a prefix of
    completed: bool = False  # both sends completed and recorded (on_sent)

    @property
    def nbytes(self) -> int:
        return self.control.nbytes + (self.payload.numel() if self.payload is not None else 0)


async def _sleep_precisely(delay: float) -> None:
    """asyncio.sleep rounds up to the selector's 1 ms: sleep to within 1.5 ms of the
    deadline, then yield to the loop until it passes (a 100 Gbit/s link moves 4 MB in
    0.3 ms)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + delay
    if delay > 2e-3:
        await asyncio.sleep(delay - 1.5e-3)
    while loop.time() < deadline:
        await asyncio.sleep(0)


class _Link:
    """The sender's connection to one receiver address."""

    def __init__(self, address: str):
        self.address = address
        self.queue: asyncio.Queue[_Message] = asyncio.Queue()
        self.ep = None  # control path
        self.data_ep = None  # data path (from the receiver's worker address)
        self.data_tag = 0
        self.driver: asyncio.Task | None = None
        self.acks: asyncio.Task | None = None
        self.pull = False  # the receiver mapped this sender's pools and reads the blocks itself


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


class UcxSender(KVSender):
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
        # a CRC-32 of each payload (host pools: ~1 GB/s of one core, see docs/faults.md; CUDA pools
        # are not checked: the payload never passes through the host)
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
                gather_layer(self._caches, layer, src, group.buffer[group.count * layer_bytes:(group.count + 1) * layer_bytes])
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
            # and no buffer bound: a message costs a chain of thread hand-offs on both sides, the
            # copy ~0.1 ms per layer of 2k tokens, so a pulled message carries up to _PULL_BYTES
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
        order. Waiting on the loop instead (polling the event) costs a millisecond per
        message: asyncio cannot sleep for less than the selector's 1 ms resolution."""
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

    # ---- on the loop -------------------------------------------------------------------

    def _enqueue_many(self, batch: list[tuple[str, _Message]]) -> None:
        for address, msg in batch:
            self._enqueue(address, msg)

    def _enqueue(self, address: str, msg: _Message) -> None:
        trace.mark("s.loop", msg.key)
        if self._closed:
            self._ledger.fail_key(msg.key, KVTransferError("sender closed"))
            return
        link = self._links.get(address)
        if link is None:
            self._drop_stale_links(address)
            link = self._links[address] = _Link(address)
            link.driver = asyncio.get_running_loop().create_task(self._drive(link))
        link.queue.put_nowait(msg)

    def _drop_stale_links(self, address: str) -> None:
        """A new incarnation of a receiver at the same host and port (it restarted): the links to
        the old one are torn down (their endpoints aborted, their transfers failed), never reused."""
        where = address.partition("#")[0]
        for old in [link for key, link in self._links.items() if key != address and key.partition("#")[0] == where]:
            del self._links[old.address]
            error = KVTransferError(f"KV receiver at {where} restarted (now {address}); "
                                    f"transfers to {old.address} are dropped")
            logger.warning("%s", error)
            self._ledger.fail_address(old.address, error)
            for task in (old.driver, old.acks):
                if task is not None:
                    task.cancel()
            _abort_link(old)

    async def _shutdown(self) -> None:
        links = list(self._links.values())
        self._links.clear()
        bye = np.frombuffer(WireHeader(MsgKind.BYE, fingerprint=self.layout.fingerprint).pack(), dtype=np.uint8)
        for link in links:
            if link.data_ep is not None:
                try:  # ends the receiver's data loop for this connection
                    await asyncio.wait_for(link.data_ep.send(bye, tag=link.data_tag, force_tag=True), 1.0)
                except Exception as e:
                    logger.debug("BYE to %s: %s", link.address, e)
            _abort_link(link)
        tasks = [t for link in links for t in (link.driver, link.acks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _connect(self, link: _Link) -> None:
        host, port = parse_address(link.address)
        try:
            link.ep = await asyncio.wait_for(
                self._rt.ucxx.create_endpoint(host, port, connect_timeout=self._connect_timeout),
                self._connect_timeout,
            )
        except Exception as e:
            raise KVTransferError(f"cannot connect to KV receiver {link.address}: {type(e).__name__}: {e}") from e
        hello = pack_hello(MsgKind.HELLO, self.layout, extra=self._descriptor, model=self._model,
                           status=HELLO_AUTH if self._token is not None else 0)
        await link.ep.send(np.frombuffer(hello, dtype=np.uint8))
        reply = np.zeros(HEADER_BYTES + LAYOUT_BYTES + MAX_MODEL_NAME_BYTES + _MAX_WORKER_ADDRESS, dtype=np.uint8)
        header = await self._handshake_reply(link, reply)
        proof = None  # the proof the receiver must put first in HELLO_OK
        if header.kind == MsgKind.CHALLENGE:
            if self._token is None:
                raise KVTransferError(f"KV peer refused: cluster token mismatch: the KV receiver {link.address} "
                                      "requires the cluster token and this sender has none")
            if header.num_bytes != NONCE_BYTES:
                raise KVTransferError(f"KV receiver {link.address} sent a CHALLENGE of {header.num_bytes} bytes")
            server_nonce = reply[HEADER_BYTES:HEADER_BYTES + NONCE_BYTES].tobytes()
            client_nonce = new_nonce()
            fingerprint = self.layout.fingerprint
            answer = WireHeader(MsgKind.AUTH, num_bytes=NONCE_BYTES + PROOF_BYTES, fingerprint=fingerprint).pack()
            answer += client_nonce + sender_proof(self._token, server_nonce, client_nonce, fingerprint)
            await link.ep.send(np.frombuffer(answer, dtype=np.uint8))
            proof = receiver_proof(self._token, server_nonce, client_nonce, fingerprint)
            header = await self._handshake_reply(link, reply)
        if header.kind == MsgKind.HELLO_REJECT and header.status in REFUSED_REASONS:
            raise KVTransferError(f"KV peer refused: {REFUSED_REASONS[header.status]} "
                                  f"(the KV receiver {link.address} refused this sender)")
        if header.kind == MsgKind.HELLO_OK and self._token is not None and proof is None:
            raise KVTransferError(f"KV peer refused: cluster token mismatch: the KV receiver {link.address} "
                                  "does not hold the cluster token (it asked for no proof)")
        try:
            check_handshake(self.layout, header, unpack_layout(reply[HEADER_BYTES:]), self._model,
                            hello_model(reply, header))
        except KVTransferError as e:
            raise KVTransferError(f"KV receiver {link.address} rejected the handshake: {e}") from None
        if header.kind != MsgKind.HELLO_OK or not 0 < header.num_bytes <= _MAX_WORKER_ADDRESS:
            raise KVTransferError(f"KV receiver {link.address} answered the handshake with {header.kind.name}")
        expected = address_incarnation(link.address)
        if expected and header.layers != expected:
            raise KVTransferError(
                f"KV receiver at {link.address.partition('#')[0]} is incarnation {header.layers:08x}, not "
                f"{expected:08x}: it restarted, and transfers meant for the old process are dropped")
        worker_address = hello_extra(reply, header)
        if proof is not None:
            if not verify(proof, worker_address[:PROOF_BYTES]):
                raise KVTransferError(f"KV peer refused: cluster token mismatch: the KV receiver {link.address} "
                                      "did not prove the cluster token")
            worker_address = worker_address[PROOF_BYTES:]
        ucxx = self._rt.ucxx
        link.data_ep = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(worker_address), endpoint_error_handling=False
        )
        link.data_tag = header.transfer_key
        link.pull = header.status == PULL and bool(self._descriptor)
        link.acks = asyncio.get_running_loop().create_task(self._read_replies(link))

    async def _handshake_reply(self, link: _Link, reply: np.ndarray) -> WireHeader:
        """The receiver's next handshake message, received into ``reply``."""
        reply[:HEADER_BYTES] = 0
        try:
            await asyncio.wait_for(link.ep.recv(reply), self._connect_timeout)
        except Exception as e:
            raise KVTransferError(f"no handshake reply from KV receiver {link.address}: {type(e).__name__}: {e}") from e
        return unpack_header(reply, check_version=False)

    async def _drive(self, link: _Link) -> None:
        """Connect, then send queued messages in order, up to ``max_inflight`` at once."""
        inflight: collections.deque[tuple[_Message, asyncio.Task, asyncio.Task]] = collections.deque()
        held: _Message | None = None  # fault injection: a message reordered behind the next one
        try:
            await self._connect(link)
            while True:
                while inflight and (len(inflight) >= self._max_inflight or link.queue.empty()):
                    await self._complete(inflight.popleft())
                msg = await link.queue.get()
                if self._ledger.should_skip(msg.key):
                    continue
                if msg.payload is None and not link.pull:  # grouped for a link that has since reconnected
                    self._ledger.fail_key(msg.key, KVTransferError(f"KV link to {link.address} no longer pulls"))
                    continue
                bucket = self._pacer.bucket_for(link.address) if self._pacer is not None else None
                if bucket is not None:
                    delay = bucket.reserve(msg.nbytes, msg.ready_at)
                    if delay > 0:
                        self._pacing_delay += delay
                        await _sleep_precisely(delay)
                    self._account_link(bucket, msg, waited=delay > 0)
                else:
                    self._ledger.on_posted(msg.key)
                fault = self._faults.draw() if self._faults is not None else None
                if fault is not None:
                    self._ledger.count("faults_injected")
                if fault == "drop":  # never posted; the sender believes it sent it
                    self._sent(msg)
                    continue
                if fault == "reorder" and held is None and not link.queue.empty():
                    held = msg  # posted after the next message
                    continue
                if fault == "corrupt" and msg.payload is not None:
                    flat = msg.payload.view(torch.uint8).reshape(-1)
                    flat[self._faults.byte_to_flip(flat.numel())] ^= 0x5A
                trace.mark("s.post", msg.key)
                self._post(link, msg, inflight)
                if fault == "duplicate":
                    copy = _Message(msg.key, msg.control.copy(), None if msg.payload is None else msg.payload.clone(),
                                    msg.payload_bytes, None, completed=True)
                    self._post(link, copy, inflight, watch=False)
                if held is not None:
                    self._post(link, held, inflight)
                    held = None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = e if isinstance(e, KVTransferError) else KVTransferError(
                f"KV link to {link.address} failed: {type(e).__name__}: {e}"
            )
            logger.error("%s", error)
            if self._links.get(link.address) is link:
                del self._links[link.address]  # the next send_layer reconnects
            self._ledger.fail_address(link.address, error)
            for msg, control, payload in inflight:
                for task in (control, payload):
                    if task is not None:
                        task.cancel()
            while not link.queue.empty():
                self._ledger.fail_key(link.queue.get_nowait().key, error)
            if link.acks is not None:
                link.acks.cancel()
            _abort_link(link)

    def _post(self, link: _Link, msg: _Message, inflight: collections.deque, watch: bool = True) -> None:
        # Tasks take their first step (which posts the UCX send) in creation order,
        # so the receiver matches control and payload of each message in order.
        loop = asyncio.get_running_loop()
        control = loop.create_task(link.data_ep.send(msg.control, tag=link.data_tag, force_tag=True))
        payload = None
        if msg.payload is not None:
            payload = loop.create_task(link.data_ep.send(wire_buffer(msg.payload), tag=link.data_tag, force_tag=True))
        if watch:
            self._watch(msg, control, payload)
        inflight.append((msg, control, payload))

    def _account_link(self, bucket, msg: _Message, waited: bool) -> None:
        """Records ``msg`` as posted through ``bucket``, with the link's time on it when the
        bucket, not the sender's compute, held it back (kvtransfer.pacing.LinkHolds)."""
        held = self._holds.posted(bucket, self._pacer.now(), waited, msg.ready_at)
        self._ledger.on_posted(msg.key, link_bytes=msg.nbytes if held is not None else 0, link_s=held or 0.0,
                               paced=True)

    def _watch(self, msg: _Message, control: asyncio.Task, payload: asyncio.Task) -> None:
        """Records ``msg`` as sent as soon as both its sends complete. The driver awaits them only
        when its in-flight window is full or its queue runs dry, which on a paced link with a
        transfer queued behind can be ``max_inflight`` paced messages later: finish() (which
        waits for every message sent) then returned that much after the acknowledgement."""
        tasks = [t for t in (control, payload) if t is not None]

        def done(_task: asyncio.Task) -> None:
            if msg.completed or not all(t.done() for t in tasks):
                return
            for task in tasks:
                if task.cancelled() or task.exception() is not None:
                    return  # the driver's _complete raises it
            self._sent(msg)
        for task in tasks:
            task.add_done_callback(done)

    def _sent(self, msg: _Message) -> None:
        trace.mark("s.sent", msg.key)
        msg.completed = True
        self._ledger.on_sent(msg.key, msg.payload_bytes)
        if self._host_buffers is not None and msg.payload is not None:
            with self._buffers_lock:
                self._host_buffers.give(msg.buffer if msg.buffer is not None else msg.payload)

    async def _complete(self, entry: tuple[_Message, asyncio.Task, asyncio.Task]) -> None:
        msg, control, payload = entry
        await control
        if payload is not None:
            await payload
        if not msg.completed:
            self._sent(msg)

    async def _read_replies(self, link: _Link) -> None:
        buf = np.zeros(HEADER_BYTES, dtype=np.uint8)
        try:
            while True:
                await link.ep.recv(buf)
                header = unpack_header(buf, expected_fingerprint=self.layout.fingerprint)
                if header.kind == MsgKind.ACK:
                    trace.mark("s.ack", header.transfer_key)
                    self._ledger.on_ack(header.transfer_key)
                elif header.kind == MsgKind.NACK:
                    self._ledger.on_nack(header.transfer_key, NackReason(header.status))
                else:
                    raise KVTransferError(f"unexpected {header.kind.name} from KV receiver {link.address}")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if self._closed:
                return
            error = KVTransferError(f"KV receiver {link.address} went away: {type(e).__name__}: {e}")
            logger.warning("%s", error)
            self._ledger.fail_address(link.address, error)
            if self._links.get(link.address) is link:
                del self._links[link.address]
                if link.driver is not None:
                    link.driver.cancel()
                _abort_link(link)


# Senders and receivers still open at interpreter exit are closed, so that the loop
# thread and UCX shut down in order instead of hanging in finalizers.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _close_all() -> None:
    for obj in list(_LIVE):
        try:
            obj.close()
        except Exception as e:
            logger.debug("closing %r at exit: %s", obj, e)


# threading's own exit hook runs before non-daemon threads (ucxx's notifier) are joined;
# a plain atexit hook would run after, i.e. never if one is left open.
try:
    threading._register_atexit(_close_all)
except (AttributeError, RuntimeError):
    atexit.register(_close_all)
