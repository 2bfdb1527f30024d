"""KV cache layout and the wire header that every KV transfer message carries.

Engine layout: per layer a K pool and a V pool, each a contiguous tensor
``[num_blocks, block_size, num_kv_heads, head_dim]``. Two workers may exchange KV only
if their layouts match (``num_blocks`` may differ; it is not part of the layout).

Tensor parallelism: a worker at TP > 1 holds its KV heads on several ranks; each rank's pools
are one endpoint's, and ``kv_head_start`` / ``kv_heads_total`` say which heads of the model
they hold (``[kv_head_start, kv_head_start + num_kv_heads)`` of ``kv_heads_total``; a TP=1
worker holds ``[0, num_kv_heads)`` of ``num_kv_heads``). Both are part of the layout and of its
fingerprint: a sender whose pieces gather other heads than the receiver holds refuses to pair.

Wire format (little endian, ``WIRE_VERSION`` 4). Every message starts with a fixed
48-byte header::

    magic u32 | version u16 | kind u16 | transfer_key u64 | layer u32 | num_blocks u32
    | num_bytes u64 | fingerprint u64 | status u32 | layers u32

- HELLO / HELLO_OK / HELLO_REJECT (handshake, first message each way on a new
  connection): header followed by the 40-byte layout descriptor
  ``num_layers u32 | block_size u32 | num_kv_heads u32 | head_dim u32 | dtype 16s
  | kv_head_start u32 | kv_heads_total u32`` (v3; v2's had no head range),
  then the model's name (UTF-8, ``layer`` bytes; 0: not stated, not checked) and, on
  HELLO_OK, the receiver's incarnation in ``layers`` (a random u32 drawn at start-up, 0: not
  stated; see ``check_incarnation``). A transport may append data to HELLO_OK (UCX: the receiver's worker address, its
  length in ``num_bytes``, and the data-path tag in ``transfer_key``). UCX also appends the
  sender's pool descriptor to HELLO (``pdserve.kvtransfer.ipc``, may be empty); a HELLO_OK with
  ``status`` ``PULL`` says the receiver mapped those pools.
- With a cluster token (``pdserve.kvtransfer.auth``): the sender's HELLO sets ``HELLO_AUTH`` in ``status``; a
  receiver that holds a token answers it with CHALLENGE (header, then a 16-byte nonce in
  ``num_bytes``), the sender replies AUTH (header, then its own 16-byte nonce and a 32-byte
  HMAC-SHA256 proof), and the receiver's HELLO_OK transport data starts with its own 32-byte
  proof. A refused sender gets HELLO_REJECT whose ``status`` says why (``pdserve.kvtransfer.auth``
  ``REFUSED_*``: the token, or the interface the connection arrived on).
- LAYER (sender -> receiver): header followed by ``num_blocks`` int32 destination block
  ids; then, as a separate payload message, ``num_bytes`` bytes: for each of the ``layers``
  consecutive layers from ``layer`` on (v2; v1 had one), the K blocks then the V blocks,
  each ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous, i.e.
  ``[layers, 2, num_blocks, *block_shape]``.
- LAYER with the ``FP8_WIRE`` bit in ``status``: the payload is the same blocks in FP8
  e4m3, each ``[block_size + R + 1, num_kv_heads, head_dim]`` bytes (pdserve/kernels/kv_quant.py
  ``pack_blocks``: the data rows, R rows of per token and head float32 scales, then one row of
  per head and channel int8 power-of-two exponents; v3 had no exponent row); the
  receiver dequantizes on landing into its pools. The sender picks the precision per transfer
  (``send_layer(..., precision=)``); never on a pulled message.
- LAYER with ``status`` ``PULL`` (only on a link whose HELLO_OK said PULL): no payload
  message; the destination ids are followed by ``num_blocks`` int32 source block ids, and
  the receiver copies those blocks of those layers from the sender's mapped pools itself.
  ``num_bytes`` is still the KV bytes the message moves.
- LAYER with the ``CHECKSUM`` bit in ``status``: a u32 CRC-32 of the payload follows the block
  ids (``payload_checksum``); the receiver recomputes it and fails the transfer on a
  mismatch (NACK ``CORRUPT``), so a corrupted, truncated or misdelivered payload never lands.
- ACK / NACK (receiver -> sender), header only: the transfer landed (``num_bytes``
  landed) or was dropped (``status`` says why).
- BYE (sender -> receiver), header only: the sender closes this connection.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from pdserve.kernels.kv_quant import fp8_block_rows
from pdserve.kvtransfer.errors import KVTransferError

WIRE_MAGIC = 0x3158564B  # b"KVX1" read as little-endian u32
WIRE_VERSION = 4  # 3: the TP head range, the model's name, CHECKSUM and FP8_WIRE LAYER bits; 4: FP8 channel scales

_HEADER = struct.Struct("<IHHQIIQQII")
_LAYOUT = struct.Struct("<IIII16sII")
HEADER_BYTES = _HEADER.size  # 48
LAYOUT_BYTES = _LAYOUT.size  # 40
BLOCK_ID_BYTES = 4
MAX_BLOCKS_PER_MESSAGE = 1 << 16

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


class MsgKind(enum.IntEnum):
    HELLO = 1
    HELLO_OK = 2
    HELLO_REJECT = 3
    LAYER = 4
    ACK = 5
    NACK = 6
    BYE = 7
    CHALLENGE = 8  # receiver -> sender, after HELLO, when the receiver holds a cluster token
    AUTH = 9  # sender -> receiver: the answer to CHALLENGE


class NackReason(enum.IntEnum):
    """``status`` of a NACK: why the receiver dropped a transfer."""

    NONE = 0
    UNKNOWN_TRANSFER = 1
    DEADLINE_PASSED = 2
    CANCELLED = 3
    BAD_MESSAGE = 4
    RECEIVER_CLOSED = 5
    CORRUPT = 6  # a payload failed its checksum


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not supported for KV transfer; supported: {sorted(_DTYPES)}")


@dataclass(frozen=True)
class KVLayout:
    """Shape of one worker's KV cache, minus the pool size."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_head_start: int = 0  # tensor parallelism: the first of the model's KV heads these pools hold
    kv_heads_total: int = 0  # the model's KV heads (0: num_kv_heads, the pools hold them all)

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.kv_heads_total == 0:
            object.__setattr__(self, "kv_heads_total", self.num_kv_heads)
        if not (isinstance(self.kv_head_start, int) and 0 <= self.kv_head_start
                and self.kv_head_start + self.num_kv_heads <= self.kv_heads_total):
            raise ValueError(f"KVLayout: KV heads [{self.kv_head_start}, {self.kv_head_start + self.num_kv_heads}) "
                             f"outside the model's {self.kv_heads_total}")

    @property
    def kv_heads(self) -> tuple[int, int]:
        """[start, end) of the model's KV heads these pools hold."""
        return self.kv_head_start, self.kv_head_start + self.num_kv_heads

    def with_heads(self, start: int, total: int) -> KVLayout:
        """This layout as the pools of KV heads [start, start + num_kv_heads) of `total`."""
        return dataclasses.replace(self, kv_head_start=start, kv_heads_total=total)

    def whole(self) -> KVLayout:
        """The layout of the model's every KV head (a TP=1 worker's)."""
        return dataclasses.replace(self, num_kv_heads=self.kv_heads_total, kv_head_start=0)

    @classmethod
    def from_caches(cls, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> KVLayout:
        """Layout of ``kv_caches``: per layer ``(K, V)``, each ``[num_blocks, block_size,
        num_kv_heads, head_dim]``, contiguous, one dtype and device for all. Pools that say
        which heads they hold (``pdserve.kvtransfer.shards.HeadShards``) give their own layout."""
        own = getattr(kv_caches, "layout", None)
        if isinstance(own, KVLayout):
            return own
        if len(kv_caches) == 0:
            raise ValueError("kv_caches is empty")
        first_k = kv_caches[0][0]
        for layer, pair in enumerate(kv_caches):
            if len(pair) != 2:
                raise ValueError(f"kv_caches[{layer}] must be a (K, V) pair")
            for name, pool in zip("KV", pair):
                if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
                    raise ValueError(
                        f"kv_caches[{layer}] {name} must be a 4-D tensor "
                        "[num_blocks, block_size, num_kv_heads, head_dim]"
                    )
                if pool.shape != first_k.shape or pool.dtype != first_k.dtype or pool.device != first_k.device:
                    raise ValueError(
                        f"kv_caches[{layer}] {name} is {tuple(pool.shape)} {pool.dtype} on {pool.device}, "
                        f"layer 0 K is {tuple(first_k.shape)} {first_k.dtype} on {first_k.device}"
                    )
                if not pool.is_contiguous():
                    raise ValueError(f"kv_caches[{layer}] {name} must be contiguous")
        _, block_size, num_kv_heads, head_dim = first_k.shape
        return cls(len(kv_caches), int(block_size), int(num_kv_heads), int(head_dim), dtype_name(first_k.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V) pool."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def layer_message_bytes(self, num_blocks: int, precision: str = "full") -> int:
        """Payload bytes of one LAYER message: K then V for ``num_blocks`` blocks, in the
        pool's dtype (``"full"``) or FP8 (``"fp8"``, see ``wire_block_bytes``)."""
        return 2 * num_blocks * self.wire_block_bytes(precision)

    @property
    def fp8_wire(self) -> bool:
        """Whether a transfer may go in FP8: a floating pool wider than a byte whose head_dim
        holds the float32 scales (a multiple of 4). An FP8 pool's bytes are FP8 already."""
        return self.dtype in ("float32", "float16", "bfloat16") and self.head_dim % 4 == 0

    def wire_block_bytes(self, precision: str = "full") -> int:
        """Bytes of one block of one layer's K (or V) on the wire at ``precision``."""
        if precision not in WIRE_PRECISIONS:
            raise ValueError(f"KV wire precision must be one of {WIRE_PRECISIONS}, got {precision!r}")
        if precision == "full":
            return self.block_bytes
        if not self.fp8_wire:
            raise ValueError(f"a {self.dtype} KV layout with head_dim {self.head_dim} cannot go in FP8 on the wire")
        return fp8_block_rows(self.block_size, self.head_dim) * self.num_kv_heads * self.head_dim

    @property
    def fingerprint(self) -> int:
        """64-bit digest of the layout; equal layouts give equal fingerprints."""
        text = f"{self.num_layers}|{self.block_size}|{self.num_kv_heads}|{self.head_dim}|{self.dtype}"
        if self.kv_heads != (0, self.kv_heads_total):  # a TP rank's share: TP=1 fingerprints are unchanged
            text += f"|heads {self.kv_head_start}+{self.num_kv_heads} of {self.kv_heads_total}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def transfer_key(transfer_id: str) -> int:
    """64-bit wire key of a transfer id (ids are strings of any length)."""
    if not isinstance(transfer_id, str) or not transfer_id:
        raise ValueError(f"transfer_id must be a non-empty str, got {transfer_id!r}")
    return int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class WireHeader:
    kind: MsgKind
    transfer_key: int = 0
    layer: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    fingerprint: int = 0
    status: int = 0
    version: int = -1  # -1: this process's WIRE_VERSION at pack time
    layers: int = 1  # LAYER: consecutive layers in the payload, from `layer` on

    def pack(self) -> bytes:
        version = WIRE_VERSION if self.version < 0 else self.version
        return _HEADER.pack(
            WIRE_MAGIC, version, int(self.kind), self.transfer_key, self.layer,
            self.num_blocks, self.num_bytes, self.fingerprint, self.status, self.layers,
        )


def unpack_header(buf, expected_fingerprint: int | None = None, check_version: bool = True) -> WireHeader:
    """Parse the first ``HEADER_BYTES`` of ``buf``.

    Raises KVTransferError on a bad magic, unknown kind, another wire version (unless
    ``check_version`` is false, used by the handshake to answer with a clear reject) or
    a fingerprint other than ``expected_fingerprint``.
    """
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise KVTransferError(f"short KV header: {view.nbytes} bytes, need {HEADER_BYTES}")
    magic, version, kind, key, layer, num_blocks, num_bytes, fingerprint, status, layers = _HEADER.unpack_from(view)
    if magic != WIRE_MAGIC:
        raise KVTransferError(f"bad KV wire magic {magic:#x}, expected {WIRE_MAGIC:#x}: "
                              "peer is not a kvtransfer endpoint")
    if check_version and version != WIRE_VERSION:
        raise KVTransferError(f"KV wire version mismatch: peer speaks {version}, this process speaks {WIRE_VERSION}")
    try:
        msg_kind = MsgKind(kind)
    except ValueError:
        raise KVTransferError(f"unknown KV message kind {kind}") from None
    if expected_fingerprint is not None and fingerprint != expected_fingerprint:
        raise KVTransferError(
            f"KV layout fingerprint mismatch: peer {fingerprint:#018x}, local {expected_fingerprint:#018x}"
        )
    return WireHeader(msg_kind, key, layer, num_blocks, num_bytes, fingerprint, status, version, layers)


def pack_layout(layout: KVLayout) -> bytes:
    return _LAYOUT.pack(layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim,
                        layout.dtype.encode(), layout.kv_head_start, layout.kv_heads_total)


def unpack_layout(buf) -> KVLayout:
    view = memoryview(buf).cast("B")
    if view.nbytes < LAYOUT_BYTES:
        raise KVTransferError(f"short KV layout descriptor: {view.nbytes} bytes, need {LAYOUT_BYTES}")
    num_layers, block_size, heads, head_dim, dtype, start, total = _LAYOUT.unpack_from(view)
    try:
        return KVLayout(num_layers, block_size, heads, head_dim, dtype.rstrip(b"\0").decode(), start, total)
    except (ValueError, UnicodeDecodeError) as e:
        raise KVTransferError(f"peer sent an invalid KV layout: {e}") from None


PULL = 1  # LAYER / HELLO_OK status: the receiver reads the blocks from the sender's pools
CHECKSUM = 2  # LAYER status bit: a CRC-32 of the payload follows the block ids
CHECKSUM_BYTES = 4
MAX_MODEL_NAME_BYTES = 512
FP8_WIRE = 4  # LAYER status bit: the payload's blocks are FP8 (module docstring)
HELLO_AUTH = 8  # HELLO status bit: the sender holds a cluster token and answers a CHALLENGE
WRITTEN = 16  # LAYER status bit (NIXL backend): the sender wrote the blocks into the receiver's staging slot
DIRECT = 32  # LAYER / HELLO_OK status bit (NIXL backend): the sender wrote the blocks straight into the reserved blocks

WIRE_PRECISIONS = ("full", "fp8")  # a transfer's KV precision on the wire
# An FP8 transfer sends the sequence's first block(s) at full precision: the first token is the
# attention sink of every layer (most heads put much of their weight on it), so its K's FP8 error
# moves every later position's attention. Keeping it raises the argmax agreement of
# benchmarks/kv_wire_quality.py at one block of full-precision bytes per transfer (the figures:
# docs/usage.md, "KV precision on the wire").
FP8_FULL_HEAD_BLOCKS = 1


def payload_checksum(payload) -> int:
    """CRC-32 of a host payload (a flat uint8 tensor, or anything with the buffer protocol)."""
    if isinstance(payload, torch.Tensor):
        payload = payload.numpy()
    return zlib.crc32(memoryview(payload).cast("B"))


def pack_hello(kind: MsgKind, layout: KVLayout, extra: bytes = b"", tag: int = 0, status: int = 0,
               model: str = "", incarnation: int = 0) -> bytes:
    """A handshake message: header, layout descriptor, the model's name, then ``extra`` transport
    data (its length in ``num_bytes``)."""
    name = model.encode()[:MAX_MODEL_NAME_BYTES]
    header = WireHeader(kind, transfer_key=tag, layer=len(name), num_bytes=len(extra),
                        fingerprint=layout.fingerprint, status=status, layers=incarnation)
    return header.pack() + pack_layout(layout) + name + extra


def hello_model(buf, header: WireHeader) -> str:
    """The model name a handshake message states ("" when it states none)."""
    if header.layer > MAX_MODEL_NAME_BYTES:
        raise KVTransferError(f"handshake model name of {header.layer} bytes (at most {MAX_MODEL_NAME_BYTES})")
    view = memoryview(buf).cast("B")
    start = HEADER_BYTES + LAYOUT_BYTES
    return bytes(view[start:start + header.layer]).decode(errors="replace")


def hello_extra(buf, header: WireHeader) -> bytes:
    """The transport data of a handshake message (after the layout and the model name)."""
    start = HEADER_BYTES + LAYOUT_BYTES + header.layer
    return bytes(memoryview(buf).cast("B")[start:start + header.num_bytes])


def handshake_mismatches(local: KVLayout, header: WireHeader, peer: KVLayout, local_model: str = "",
                         peer_model: str = "") -> list[str]:
    """What differs between this side and the peer, one phrase each (the peer's value first)."""
    out = []
    if header.version != WIRE_VERSION:
        out.append(f"wire version mismatch: peer speaks {header.version}, this process speaks {WIRE_VERSION}")
    if local_model and peer_model and local_model != peer_model:
        out.append(f"model mismatch: peer serves {peer_model!r}, this process {local_model!r}")
    if peer.kv_heads != local.kv_heads or peer.kv_heads_total != local.kv_heads_total:
        out.append(f"KV tensor-parallel layout mismatch: peer holds KV heads [{peer.kv_heads[0]}, "
                   f"{peer.kv_heads[1]}) of {peer.kv_heads_total}, this side [{local.kv_heads[0]}, "
                   f"{local.kv_heads[1]}) of {local.kv_heads_total}")
    fields = [f"{name}={getattr(peer, name)} (local {name}={getattr(local, name)})"
              for name in ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
              if getattr(peer, name) != getattr(local, name)]
    if fields:
        out.append("layout mismatch: " + ", ".join(fields))
    elif header.fingerprint != local.fingerprint:
        out.append(f"layout mismatch: fingerprint peer {header.fingerprint:#018x}, local {local.fingerprint:#018x}")
    return out


def check_handshake(local: KVLayout, header: WireHeader, peer: KVLayout, local_model: str = "",
                    peer_model: str = "") -> None:
    """Raise KVTransferError naming what differs between this side and the peer (wire version,
    model when both state one, dtype, block size, layer count, KV heads, head size)."""
    problems = handshake_mismatches(local, header, peer, local_model, peer_model)
    if problems:
        raise KVTransferError("KV peers do not match: " + "; ".join(problems))
