"""The UCX sender on the runtime's event loop: ``SenderLoop``, a base of ``UcxSender``.

One ``_Link`` per receiver address. Control path: the sender connects to the receiver's listener
with UCX endpoint error handling on (so a dead peer is detected) and sends HELLO (wire version,
layout, model; the pools' descriptor when it offers pulls); with the cluster token it answers the
receiver's CHALLENGE and checks the receiver's proof at the head of HELLO_OK. A refusal or a
mismatch raises KVTransferError on the sender (its transfers to that address fail).

Data path: a second endpoint from the worker address in HELLO_OK, without endpoint error
handling: UCX only offers its shared-memory transports (posix, sysv, cma) and CUDA IPC to
endpoints without peer-failure handling, and these are what make same-host transfers fast. Per
message: a control message (header + int32 destination block ids) then the payload (K then V of
the blocks of one or more consecutive layers, gathered into one staging buffer), tagged with the
connection's tag and posted back to back so the receiver matches them in order. Up to
``max_inflight`` messages are in flight per connection; ``pacer`` delays them to an emulated link
rate, counting each message ready from its ``send_layer`` (the sender loop's own time between
messages is then not lost to the bucket). On close the sender sends BYE on the data path.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kvtransfer import trace
from pdserve.kvtransfer.auth import (
    NONCE_BYTES,
    PROOF_BYTES,
    REFUSED_REASONS,
    new_nonce,
    receiver_proof,
    sender_proof,
    verify,
)
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.layout import (
    HEADER_BYTES,
    HELLO_AUTH,
    LAYOUT_BYTES,
    MAX_MODEL_NAME_BYTES,
    PULL,
    MsgKind,
    NackReason,
    WireHeader,
    check_handshake,
    hello_extra,
    hello_model,
    pack_hello,
    unpack_header,
    unpack_layout,
)
from pdserve.kvtransfer.ledger import SendLedger
from pdserve.kvtransfer.pacing import LinkPacer
from pdserve.kvtransfer.staging import wire_buffer
from pdserve.kvtransfer.ucx_runtime import UcxRuntime, abort_endpoint, address_incarnation, parse_address

logger = logging.getLogger(__name__)


def _abort_link(link) -> None:
    for ep in (link.data_ep, link.ep):
        if ep is not None:
            abort_endpoint(ep)


_MAX_WORKER_ADDRESS = 64 * 1024


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
    """asyncio.sleep rounds up to the selector's resolution: sleep to just short of the
    deadline, then yield to the loop until it passes (a fast link moves a message in a
    fraction of that resolution)."""
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


class SenderLoop:
    """``UcxSender``'s methods that run on the runtime's event loop: each receiver address's
    ``_Link`` (connect and handshake, the driver that posts its messages in order, the reader of
    its ACKs and NACKs) and the sender's shutdown. The state they use is ``UcxSender``'s."""

    _links: dict[str, _Link]
    _ledger: SendLedger
    _rt: UcxRuntime
    _pacer: LinkPacer | None
    _closed: bool

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
