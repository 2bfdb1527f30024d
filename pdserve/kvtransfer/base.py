"""Interfaces of the KV data plane and the backend registry.

Lifecycle of one transfer (prefill worker P -> decode worker D):

1. D builds a ``KVReceiver`` over its KV caches once, and publishes ``address()``.
2. For a request, D reserves blocks and calls ``expect(transfer_id, block_ids, ...)``.
3. P calls ``send_layer(address, transfer_id, layer, src, dst)`` right after each layer
   (or chunk) is computed; it only enqueues, so the transfer overlaps compute.
4. P calls ``finish(transfer_id)``: returns once D has acknowledged every layer.
5. D calls ``wait(transfer_id)``: returns once every layer landed in its blocks, or
   raises ``KVTransferTimeout`` past the deadline (D then prefills locally) or
   ``KVTransferError``. After a deadline or ``cancel``, late data for the transfer is
   dropped and never written into the (possibly reused) blocks.

Faults (docs/faults.md): the handshake refuses a peer of another wire version, model, dtype,
block size or shape, naming what differs; a payload failing its CRC-32 (host pools) fails the
transfer (``KVTransferCorrupt`` on both sides) and nothing of it is used; a lost message leaves
the transfer incomplete until its deadline; a receiver that restarted at the same address has
another incarnation (in its address), so transfers meant for the old process fail instead of
landing in the new one. ``pdserve.kvtransfer.faults`` injects such faults for tests.

``kv_caches`` everywhere: per layer ``(K, V)``, each a contiguous tensor
``[num_blocks, block_size, num_kv_heads, head_dim]``, on CPU or CUDA.
All methods are thread-safe and may be called from the engine's thread.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


# Where a transfer's time went (seconds), as ``TransferResult.phases`` reports it.
# Sender: ``stage``: first send_layer to the last message staged (gathered; in serving this
# includes the compute of the later layers); ``queue``: first send_layer to the first message
# posted (connecting, waiting for an in-flight slot, pacing); ``wire``: first message posted to
# the last one completed; ``ack``: last message completed to the receiver's acknowledgement;
# ``link`` (paced links only, absent otherwise; overlaps ``queue`` and ``wire``): the time the link was busy with
# the transfer's messages that were ready before the link was free (queued behind earlier
# bytes) and waited for the token bucket, so that the link, not the compute, held them (those
# the bucket let through at once, its burst, are left out); ``TransferResult.link_bytes`` are
# those messages' bytes and link_bytes / link is the rate the link delivered while it was the
# bottleneck (its SET rate when pacing holds).
# Receiver: ``scatter``: time spent writing payloads into the reserved blocks (summed);
# ``land``: last payload received to the transfer marked landed.
SENDER_PHASES = ("stage", "queue", "wire", "ack", "link")
RECEIVER_PHASES = ("scatter", "land")


@dataclass(frozen=True)
class TransferResult:
    """One finished transfer: payload bytes moved, seconds from the first layer to the
    last landing (receiver) or to the acknowledgement (sender), the rate in Gbit/s, and
    where the time went (``phases``, see SENDER_PHASES / RECEIVER_PHASES); ``link_bytes``
    (sender, paced links): the bytes the link carried while it was the bottleneck (phase
    ``link``); ``finished_at``: the ``time.monotonic()`` of that end (landing or acknowledgement), one
    clock for every process of a host, so a sender's start and a receiver's landing compare."""

    transfer_id: str
    num_bytes: int
    seconds: float
    gbps: float
    phases: dict[str, float] = field(default_factory=dict, compare=False)
    link_bytes: int = field(default=0, compare=False)
    finished_at: float = field(default=0.0, compare=False)

    @classmethod
    def of(cls, transfer_id: str, num_bytes: int, seconds: float,
           phases: dict[str, float] | None = None, link_bytes: int = 0, finished_at: float = 0.0) -> TransferResult:
        seconds = max(seconds, 1e-9)
        return cls(transfer_id, num_bytes, seconds, num_bytes * 8 / seconds / 1e9, dict(phases or {}), int(link_bytes),
                   float(finished_at))


class KVReceiver(abc.ABC):
    """Decode side: lands KV pushed by senders into blocks reserved for each transfer."""

    @abc.abstractmethod
    def address(self) -> str:
        """Opaque string a sender connects with, e.g. ``"ucx://10.0.0.5:41234"``."""

    @abc.abstractmethod
    def expect(self, transfer_id: str, block_ids: Sequence[int], num_layers: int, deadline_s: float) -> None:
        """Register the landing blocks of ``transfer_id``.

        ``block_ids``: ``[n]`` distinct ids into this receiver's pools; K and V of every
        layer in ``range(num_layers)`` must land in all of them. ``deadline_s``: seconds
        from now after which the transfer is dropped. Raises ValueError on bad
        arguments, KVTransferError if ``transfer_id`` is already expected.
        """

    @abc.abstractmethod
    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        """Block until every layer of ``transfer_id`` landed; verifies layer, block and
        byte counts. Raises KVTransferTimeout when the deadline passes (the transfer is
        then dropped) or when ``timeout`` runs out first (the transfer stays expected),
        KVTransferError when it failed or is unknown."""

    @abc.abstractmethod
    def cancel(self, transfer_id: str) -> None:
        """Drop ``transfer_id``; once this returns nothing more is written into its blocks.
        Unknown ids are ignored."""

    @abc.abstractmethod
    def metrics(self) -> dict[str, float]:
        """Counters: bytes, messages, transfers by outcome, seconds."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop receiving; pending transfers fail. Idempotent."""

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KVSender(abc.ABC):
    """Prefill side: pushes blocks of its KV caches to receivers."""

    @abc.abstractmethod
    def send_layer(
        self,
        address: str,
        transfer_id: str,
        layer: int,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        precision: str = "full",
    ) -> None:
        """Enqueue K and V of ``layer`` for blocks ``src_block_ids`` ``[n]`` (local ids) to
        land in ``dst_block_ids`` ``[n]`` (the receiver's ids), and return at once.

        ``precision`` (per call, so per transfer): ``"full"`` sends the pool's bytes; ``"fp8"``
        quantizes the blocks to FP8 e4m3 with per token and head scales (kvtransfer.layout,
        ``FP8_WIRE``) and the receiver dequantizes them on landing. From an FP8 pool, or a
        layout that cannot (``KVLayout.fp8_wire``), ``"fp8"`` sends the pool's bytes as is.

        The blocks are gathered at call time (on CUDA: enqueued on the current stream,
        so the call orders after the kernels that wrote them). Raises ValueError on bad
        arguments.
        """

    @abc.abstractmethod
    def finish(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        """Block until every enqueued layer of ``transfer_id`` was delivered and the
        receiver acknowledged the whole transfer. Raises KVTransferTimeout, or
        KVTransferError when the receiver rejected or dropped it."""

    @abc.abstractmethod
    def metrics(self) -> dict[str, float]:
        """Counters: bytes, messages, transfers by outcome, seconds, pacing delay."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close connections; unfinished transfers fail. Idempotent."""

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wire_fp8(layout, precision: str) -> bool:
    """Whether a message at ``precision`` (kvtransfer.layout.WIRE_PRECISIONS) of a sender
    with ``layout`` goes quantized to FP8: ValueError on an unknown precision."""
    if precision not in ("full", "fp8"):
        raise ValueError(f"KV wire precision must be 'full' or 'fp8', got {precision!r}")
    return precision == "fp8" and layout.fp8_wire


# name -> "module:SenderClass:ReceiverClass", imported on first use
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "fake": ("pdserve.kvtransfer.fake", "FakeSender", "FakeReceiver"),
    "ucx": ("pdserve.kvtransfer.ucx", "UcxSender", "UcxReceiver"),
    "nixl": ("pdserve.kvtransfer.nixl", "NixlSender", "NixlReceiver"),  # needs the nixl extra (pdserve[nixl])
}


def register_backend(name: str, module: str, sender_cls: str, receiver_cls: str) -> None:
    """Register a backend by name; ``module`` is imported lazily on first use."""
    if name in _BACKENDS:
        raise ValueError(f"KV transfer backend {name!r} is already registered")
    _BACKENDS[name] = (module, sender_cls, receiver_cls)


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def _backend_class(backend: str, index: int) -> Callable:
    if backend not in _BACKENDS:
        raise ValueError(f"unknown KV transfer backend {backend!r}; known: {available_backends()}")
    entry = _BACKENDS[backend]
    return getattr(importlib.import_module(entry[0]), entry[index])


def create_sender(backend: str, kv_caches: KVCaches, **opts) -> KVSender:
    """A sender of backend ``backend`` (``"fake"``, ``"ucx"``, ``"nixl"``) over ``kv_caches``.
    Unknown options raise TypeError naming them."""
    return _backend_class(backend, 1)(kv_caches, **opts)


def create_receiver(backend: str, kv_caches: KVCaches, **opts) -> KVReceiver:
    """A receiver of backend ``backend`` (``"fake"``, ``"ucx"``, ``"nixl"``) over ``kv_caches``.
    Unknown options raise TypeError naming them."""
    return _backend_class(backend, 2)(kv_caches, **opts)
