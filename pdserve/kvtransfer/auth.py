"""Who may open a KV connection: the cluster token proved by challenge and response, and the
interface a connection must arrive on. Pure (no UCX): the UCX backend calls these.

Token (``token``, the cluster's shared secret, the same string the router and the workers'
gRPC planes carry; None: a dev cluster without one, where nothing is checked). The token never
crosses the wire; each side proves it holds it with an HMAC-SHA256 over fresh nonces::

    sender                                   receiver
    HELLO (status HELLO_AUTH)      ->
                                   <-        CHALLENGE (server nonce, 16 bytes)
    AUTH (client nonce, 16 bytes,
          HMAC(token, "hello" sn cn fp))  ->  verified before anything is reserved or mapped
                                   <-        HELLO_OK (HMAC(token, "ok" cn sn fp), then the
                                             worker address) or HELLO_REJECT (REFUSED_TOKEN)

``fp`` is the sender's layout fingerprint, so a proof made for one HELLO answers no other. A
receiver with a token refuses a HELLO without the HELLO_AUTH bit, and a sender with a token refuses
a receiver that answers HELLO_OK without a challenge (it proves nothing): a cluster either
uses a token on every worker or on none.

Interface: the ucxx listener (ucxx 0.52's Python ``create_listener``) binds every interface
and takes no address, so the receiver asks UCX which local address each accepted connection
arrived on (``pdserve.kvtransfer.ucx_runtime.endpoint_sockaddrs``) and refuses one that did not arrive
on an allowed address (``allowed_addresses``, ``address_allowed``)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket

NONCE_BYTES = 16
PROOF_BYTES = 32  # HMAC-SHA256
ANY_INTERFACE = "any"

# HELLO_REJECT status: why the receiver refused the sender before the layout check
REFUSED_TOKEN = 1
REFUSED_INTERFACE = 2
REFUSED_REASONS = {
    REFUSED_TOKEN: "cluster token mismatch",
    REFUSED_INTERFACE: "connection arrived on an interface the KV plane does not serve",
}


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _mac(token: str, label: bytes, first: bytes, second: bytes, fingerprint: int) -> bytes:
    message = b"pdserve-kv-" + label + b"\0" + first + second + fingerprint.to_bytes(8, "little")
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def sender_proof(token: str, server_nonce: bytes, client_nonce: bytes, fingerprint: int) -> bytes:
    """What the sender answers a CHALLENGE with (after its own nonce)."""
    return _mac(token, b"hello", server_nonce, client_nonce, fingerprint)


def receiver_proof(token: str, server_nonce: bytes, client_nonce: bytes, fingerprint: int) -> bytes:
    """What the receiver puts first in HELLO_OK's transport data."""
    return _mac(token, b"ok", client_nonce, server_nonce, fingerprint)


def verify(expected: bytes, given: bytes) -> bool:
    return len(given) == len(expected) and hmac.compare_digest(expected, given)


# ---- interfaces --------------------------------------------------------------------------

def allowed_addresses(host: str, interface: str | None) -> frozenset[str] | None:
    """The local addresses a receiver advertised at ``host`` accepts connections on:
    ``interface`` None means ``host`` itself; ``"any"`` (or a wildcard address) means every
    interface (returns None: no check). A name resolves to all its addresses. ValueError naming
    the address when it resolves to nothing."""
    where = host if interface is None else interface
    if where == ANY_INTERFACE or where in ("", "0.0.0.0", "::"):
        return None
    try:
        return frozenset({str(ipaddress.ip_address(where.strip("[]")))})
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(where, None, proto=socket.IPPROTO_TCP)
    except OSError as e:
        raise ValueError(f"KV interface {where!r} does not resolve: {e}") from None
    return frozenset(str(ipaddress.ip_address(info[4][0].split("%")[0])) for info in infos)


def address_allowed(local: str | None, allowed: frozenset[str] | None) -> bool:
    """Whether a connection that arrived on local address ``local`` may proceed (an IPv4
    address mapped into IPv6 counts as the IPv4 one)."""
    if allowed is None:
        return True
    if local is None:
        return False
    address = ipaddress.ip_address(local)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address) in allowed
