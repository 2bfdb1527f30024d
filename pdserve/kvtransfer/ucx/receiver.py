"""The UCX backend's receiver (decode side): ``UcxReceiver``.

Control path: before HELLO, the receiver refuses a connection that did not arrive on the address
it serves (``interface``), and, when it holds the cluster token (``token``), challenges the
sender to prove it holds it too (``pdserve.kvtransfer.auth``): a refused sender gets
HELLO_REJECT with the reason, nothing is reserved or mapped for it and its endpoint is closed.
A HELLO of another wire version, layout or model is logged, counted (``handshake_errors``) and
answered HELLO_REJECT. HELLO_OK carries the receiver's UCX worker address and a per-connection
tag.

Data path: the receiver keeps receives posted ahead: as soon as a control message is parsed it
posts the payload's receive into a free staging slot (one of ``PDSERVE_KV_RECV_SLOTS``, default
8, per connection; CUDA memory for CUDA caches) and then the next control receive, so several
payloads are on the wire at once. A landing thread scatters each payload into the reserved
blocks on a CUDA stream of its own (never on the event loop, never behind the engine's kernels)
and frees its slot; when a transfer has fully landed it sends ACK (on the control path) to
every sender that contributed, NACK when it drops one (deadline, cancel, bad message, unknown
id). Failure of a peer is seen on the control path, which then tears down the data path.

Pull path: a HELLO that carries the sender's pool descriptor (``pdserve.kvtransfer.ipc``), which
this receiver maps, is answered HELLO_OK with status PULL. From then on a message is the control
message alone (header with status PULL, destination ids, then source ids), and the landing thread
copies those blocks from the sender's pools into the reserved ones in one kernel (reads over
NVLink), then ACKs as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import queue
import threading
import time

import numpy as np
import torch

from pdserve.kernels.kv_quant import fp8_block_rows
from pdserve.kvtransfer import trace
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
from pdserve.kvtransfer.base import KVCaches
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.ipc import MAX_DESCRIPTOR_BYTES, import_pools
from pdserve.kvtransfer.settings import current as kv_settings
from pdserve.kvtransfer.layout import (
    BLOCK_ID_BYTES,
    CHECKSUM,
    CHECKSUM_BYTES,
    FP8_WIRE,
    HEADER_BYTES,
    HELLO_AUTH,
    LAYOUT_BYTES,
    MAX_BLOCKS_PER_MESSAGE,
    PULL,
    KVLayout,
    MsgKind,
    NackReason,
    WireHeader,
    check_handshake,
    hello_extra,
    hello_model,
    pack_hello,
    payload_checksum,
    unpack_header,
    unpack_layout,
)
from pdserve.kvtransfer.ledger import FP8Payload, LedgerReceiver, PullSource, ReceiveLedger
from pdserve.kvtransfer.staging import wire_buffer
from pdserve.kvtransfer.ucx.common import _LIVE, _check_token
from pdserve.kvtransfer.ucx_runtime import SCHEME, TaskSet, UcxRuntime, abort_endpoint, endpoint_sockaddrs

logger = logging.getLogger(__name__)


def _recv_slots() -> int:
    return kv_settings().recv_slots  # PDSERVE_KV_RECV_SLOTS, at the process's start


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
