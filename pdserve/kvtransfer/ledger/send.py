"""The prefill side's bookkeeping: ``SendLedger`` holds every transfer in flight (messages
enqueued, staged, posted, sent; the acknowledgement or the error) and times its phases."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from pdserve.kvtransfer.base import SENDER_PHASES, TransferResult
from pdserve.kvtransfer.errors import KVTransferCorrupt, KVTransferError, KVTransferTimeout
from pdserve.kvtransfer.layout import NackReason, transfer_key

SENDER_COUNTERS = (
    "transfers_started", "transfers_completed", "transfers_failed", "messages_sent", "bytes_sent", "transfer_seconds",
    "messages_skipped", "link_bytes", "faults_injected",
) + tuple(f"{phase}_seconds" for phase in SENDER_PHASES)


@dataclass
class _Outgoing:
    transfer_id: str
    key: int
    address: str
    started: float
    enqueued: int = 0
    sent: int = 0
    num_bytes: int = 0
    acked_at: float | None = None
    error: KVTransferError | None = None
    staged_at: float | None = None  # the latest message staged (gathered)
    posted_at: float | None = None  # the first message posted on the wire
    sent_at: float | None = None  # the latest message completed
    link_bytes: int = 0  # bytes of messages posted while the link held them back (see on_posted)
    link_s: float = 0.0  # the link's time on those messages
    paced: bool = False  # a message went through a paced link's bucket (phase "link" is reported)

    def phases(self) -> dict[str, float]:
        end = self.acked_at or self.started
        staged = self.staged_at or self.started
        posted = self.posted_at or self.started
        sent = self.sent_at or posted
        phases = {"stage": staged - self.started, "queue": posted - self.started,
                  "wire": max(0.0, sent - posted), "ack": max(0.0, end - sent)}
        if self.paced:
            phases["link"] = self.link_s
        return phases


class SendLedger:
    """Sender-side state of every transfer in flight; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cond = threading.Condition()
        self._by_id: dict[str, _Outgoing] = {}
        self._by_key: dict[int, _Outgoing] = {}
        self.counters: dict[str, float] = dict.fromkeys(SENDER_COUNTERS, 0.0)

    def on_enqueue(self, transfer_id: str, address: str, nbytes: int) -> int:
        """Record one more message of ``transfer_id``; returns its wire key."""
        with self._cond:
            out = self._by_id.get(transfer_id)
            if out is None:
                key = transfer_key(transfer_id)
                out = _Outgoing(transfer_id, key, address, self._clock())
                self._by_id[transfer_id] = out
                self._by_key[key] = out
                self.counters["transfers_started"] += 1
            elif out.address != address:
                raise ValueError(f"transfer {transfer_id!r} goes to {out.address}, not {address}")
            out.enqueued += 1
            return out.key

    def on_staged(self, key: int) -> None:
        """A message of ``key`` is gathered and ready for the wire."""
        now = self._clock()
        with self._cond:
            out = self._by_key.get(key)
            if out is not None:
                out.staged_at = now

    def on_posted(self, key: int, link_bytes: int = 0, link_s: float = 0.0, paced: bool = False) -> None:
        """A message of ``key`` was posted to the transport; ``link_bytes`` and ``link_s``: its
        bytes and the link's time on them when the link, not the sender, held it back (a paced
        link with a backlog; see UcxSender._account_link); ``paced``: it went through a paced
        link's bucket (the transfer then reports phase ``link``, 0 when the bucket held nothing)."""
        now = self._clock()
        with self._cond:
            out = self._by_key.get(key)
            if out is not None:
                if out.posted_at is None:
                    out.posted_at = now
                out.link_bytes += link_bytes
                out.link_s += link_s
                out.paced = out.paced or paced

    def on_sent(self, key: int, nbytes: int) -> None:
        now = self._clock()
        with self._cond:
            self.counters["messages_sent"] += 1
            self.counters["bytes_sent"] += nbytes
            out = self._by_key.get(key)
            if out is not None:
                out.sent += 1
                out.num_bytes += nbytes
                out.sent_at = now
                self._cond.notify_all()

    def should_skip(self, key: int) -> bool:
        """True when the transfer already failed (e.g. the receiver dropped it): its
        remaining messages need not cross the link. Counts the skip."""
        with self._cond:
            out = self._by_key.get(key)
            if out is not None and out.error is None:
                return False
            self.counters["messages_skipped"] += 1
            return True

    def on_ack(self, key: int) -> None:
        with self._cond:
            out = self._by_key.get(key)
            if out is not None and out.acked_at is None:
                out.acked_at = self._clock()
                self._cond.notify_all()

    def on_nack(self, key: int, reason: NackReason) -> None:
        # A missed deadline is a timeout on both sides, so callers can fall back instead of
        # treating the peer as broken.
        kind = {NackReason.DEADLINE_PASSED: KVTransferTimeout, NackReason.CORRUPT: KVTransferCorrupt}.get(
            reason, KVTransferError)
        self.fail_key(key, kind(f"receiver dropped the transfer: {reason.name.lower()}"))

    def count(self, name: str, value: float = 1.0) -> None:
        with self._cond:
            self.counters[name] += value

    def fail_key(self, key: int, error: KVTransferError) -> None:
        with self._cond:
            out = self._by_key.get(key)
            if out is not None and out.error is None and out.acked_at is None:
                out.error = error
                self._cond.notify_all()

    def fail_address(self, address: str, error: KVTransferError) -> None:
        with self._cond:
            for out in self._by_key.values():
                if out.address == address and out.error is None and out.acked_at is None:
                    out.error = error
            self._cond.notify_all()

    def fail_all(self, error: KVTransferError) -> None:
        with self._cond:
            for out in self._by_key.values():
                if out.error is None and out.acked_at is None:
                    out.error = error
            self._cond.notify_all()

    def finish(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        end = None if timeout is None else self._clock() + timeout
        with self._cond:
            out = self._by_id.get(transfer_id)
            if out is None:
                raise KVTransferError(f"transfer {transfer_id!r} has no layers sent by this sender")
            try:
                while out.error is None and (out.acked_at is None or out.sent < out.enqueued):
                    now = self._clock()
                    if end is not None and now >= end:
                        self.counters["transfers_failed"] += 1
                        raise KVTransferTimeout(
                            f"transfer {transfer_id!r} not acknowledged within {timeout:.3f}s "
                            f"({out.sent}/{out.enqueued} messages sent)"
                        )
                    self._cond.wait(None if end is None else end - now)
                if out.error is not None:
                    self.counters["transfers_failed"] += 1
                    raise out.error
                seconds = out.acked_at - out.started
                phases = out.phases()
                self.counters["transfers_completed"] += 1
                self.counters["transfer_seconds"] += seconds
                for phase, value in phases.items():
                    self.counters[f"{phase}_seconds"] += value
                self.counters["link_bytes"] += out.link_bytes
                return TransferResult.of(transfer_id, out.num_bytes, seconds, phases, out.link_bytes, out.acked_at)
            finally:
                del self._by_id[transfer_id]
                del self._by_key[out.key]

    def snapshot(self) -> dict[str, float]:
        with self._cond:
            out = dict(self.counters)
            out["transfers_in_flight"] = float(len(self._by_id))
            return out
