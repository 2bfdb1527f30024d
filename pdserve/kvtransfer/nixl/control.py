"""The NIXL backend's control path: a TCP connection per sender and receiver, length-prefixed
frames carrying the UCX backend's wire messages (``pdserve.kvtransfer.layout``) and this
backend's own frames (the cluster token's challenge and response before HELLO; CREDIT, a WRITE
staging slot free again; FENCE and FENCED, a DIRECT sender's fence); and the receiver's address,
``nixl://host:port/<incarnation>``, which names its process: a receiver restarted at the same
port refuses transfers meant for the old one."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Sequence

from pdserve.kvtransfer.errors import KVTransferError

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
_MAX_FRAME = 64 << 20


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


# The control connection's first exchange, before HELLO: the cluster token proved by challenge
# and response (kvtransfer.auth; the token never crosses the wire). The receiver opens with
# AUTH_NONE (no token) or AUTH_CHALLENGE + its nonce; a sender with the token answers its nonce
# and proof, and the receiver answers AUTH_OK + its own proof or AUTH_REFUSED + the reason.
AUTH_NONE, AUTH_CHALLENGE, AUTH_OK, AUTH_REFUSED = b"PDKV0", b"PDKV1", b"PDKVY", b"PDKVN"
_AUTH_FP = 0  # the proof binds the nonces only: the layouts are compared at HELLO, after it


def _refused(address: str, reason: str) -> KVTransferError:
    return KVTransferError(f"KV peer refused: {reason} (receiver {address})")
