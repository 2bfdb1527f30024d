"""Who may open a KV connection (kvtransfer.auth): the cluster token, proved by challenge and
response over UCX between two processes on loopback, and the interface a connection arrives on.

Loopback only: the "other interface" is another address of 127.0.0.0/8. ucxx must initialise
here: a failure is a test failure, never a skip.
"""

import logging
import time

import pytest

from pdserve import kvtransfer
from pdserve.kvtransfer import KVTransferError
from pdserve.kvtransfer.auth import (
    NONCE_BYTES,
    PROOF_BYTES,
    address_allowed,
    allowed_addresses,
    new_nonce,
    receiver_proof,
    sender_proof,
    verify,
)
from kvx_peer import CacheSpec, Peer, PeerError, block_bytes, make_caches

pytestmark = pytest.mark.timeout(60)

FP32 = CacheSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
TOKEN = "a" * 32
OTHER = "b" * 32
SRC, DST = [9, 2, 14], [3, 11, 0]


@pytest.fixture(scope="module")
def peer():
    peer = Peer()
    yield peer
    assert peer.stop() == 0, "peer process did not exit cleanly"


def _untouched(peer) -> bool:
    zeros = make_caches(FP32, seed=None)
    return all(peer.call("read", layer, DST) == block_bytes(zeros, layer, DST) for layer in range(3))


def _refused(metrics_of, expected: int = 1) -> dict:
    """The receiver's metrics once it counted ``expected`` refusals (a sender that holds no token
    hangs up on the challenge; the receiver sees that a moment after the sender raised)."""
    deadline = time.monotonic() + 10
    while (metrics := metrics_of())["peers_refused"] < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return metrics


def _send(sender, address: str, transfer_id: str):
    for layer in range(3):
        sender.send_layer(address, transfer_id, layer, SRC, DST)
    return sender.finish(transfer_id, timeout=15)


# ---- the token ---------------------------------------------------------------------------

@pytest.mark.parametrize("sender_token", [None, OTHER], ids=["no-token", "wrong-token"])
def test_receiver_with_token_refuses_a_sender_without_it(peer, sender_token, caplog):
    address = peer.call("open_receiver", FP32, token=TOKEN)
    peer.call("expect", "refused", DST, 3, 10.0)
    with caplog.at_level(logging.ERROR, logger="pdserve.kvtransfer.ucx"):
        with kvtransfer.create_sender("ucx", make_caches(FP32, seed=1), token=sender_token) as sender:
            with pytest.raises(KVTransferError, match="KV peer refused: cluster token mismatch"):
                _send(sender, address, "refused")
            assert sender.metrics()["transfers_failed"] == 1
    assert "KV peer refused: cluster token mismatch" in caplog.text  # the sender's own log
    metrics = _refused(lambda: peer.call("metrics"))
    assert metrics["peers_refused"] == 1
    assert metrics["messages_received"] == 0 and metrics["bytes_received"] == 0
    assert metrics["transfers_completed"] == 0 and metrics["pull_links"] == 0
    assert _untouched(peer)


def test_receiver_refusal_is_logged_and_nothing_lands(peer, caplog):
    """The receiver's side of a refusal, in this process: its log names the reason, and the
    expected transfer is still pending, untouched, when the refused sender is gone."""
    dst = make_caches(FP32, seed=None)
    with caplog.at_level(logging.ERROR, logger="pdserve.kvtransfer.ucx"):
        with kvtransfer.create_receiver("ucx", dst, token=TOKEN) as receiver:
            receiver.expect("refused", DST, 3, deadline_s=10)
            peer.call("open_sender", FP32, 5, token=OTHER)
            for layer in range(3):
                peer.call("send_layer", receiver.address(), "refused", layer, SRC, DST)
            with pytest.raises(PeerError, match="KV peer refused: cluster token mismatch"):
                peer.call("finish", "refused", 15.0)
            metrics = _refused(receiver.metrics)
            assert metrics["peers_refused"] == 1 and metrics["messages_received"] == 0
            assert metrics["transfers_pending"] == 1 and metrics["transfers_completed"] == 0
    assert "KV peer refused: cluster token mismatch: the sender's proof does not match" in caplog.text
    assert all(block_bytes(dst, layer, DST) == block_bytes(make_caches(FP32, None), layer, DST) for layer in range(3))


def test_sender_with_token_refuses_a_receiver_without_it(peer):
    address = peer.call("open_receiver", FP32)
    peer.call("expect", "open", DST, 3, 10.0)
    with kvtransfer.create_sender("ucx", make_caches(FP32, seed=1), token=TOKEN) as sender:
        with pytest.raises(KVTransferError, match="KV peer refused: cluster token mismatch: .* does not hold"):
            _send(sender, address, "open")
    assert peer.call("metrics")["messages_received"] == 0
    assert _untouched(peer)


def test_matching_tokens_land_exact_bytes(peer):
    address = peer.call("open_receiver", FP32, token=TOKEN)
    src = make_caches(FP32, seed=7)
    with kvtransfer.create_sender("ucx", src, token=TOKEN) as sender:
        for n in range(2):  # the second transfer reuses the authenticated connection
            peer.call("expect", f"ok-{n}", DST, 3, 15.0)
            sent = _send(sender, address, f"ok-{n}")
            landed = peer.call("wait", f"ok-{n}", 15.0)
            assert sent.num_bytes == landed.num_bytes == 3 * 2 * 3 * FP32.block_size * 2 * 8 * 4
    for layer in range(3):
        assert peer.call("read", layer, DST) == block_bytes(src, layer, SRC)
    metrics = peer.call("metrics")
    assert metrics["peers_refused"] == 0 and metrics["transfers_completed"] == 2


# ---- the interface -----------------------------------------------------------------------

def test_connection_from_another_interface_is_refused(peer):
    """The receiver serves only 127.0.0.2; the sender reaches it through 127.0.0.1 (the listener
    binds every interface, so UCX accepts the connection): refused before the handshake."""
    address = peer.call("open_receiver", FP32, host="127.0.0.1", interface="127.0.0.2")
    peer.call("expect", "elsewhere", DST, 3, 10.0)
    with kvtransfer.create_sender("ucx", make_caches(FP32, seed=1)) as sender:
        with pytest.raises(KVTransferError, match="KV peer refused: connection arrived on an interface"):
            _send(sender, address, "elsewhere")
    metrics = _refused(lambda: peer.call("metrics"))
    assert metrics["peers_refused"] == 1 and metrics["messages_received"] == 0
    assert _untouched(peer)


@pytest.mark.parametrize("interface", [None, "127.0.0.1", "any"])
def test_connection_on_the_served_interface_is_accepted(peer, interface):
    address = peer.call("open_receiver", FP32, host="127.0.0.1", interface=interface, token=TOKEN)
    src = make_caches(FP32, seed=3)
    peer.call("expect", "here", DST, 3, 15.0)
    with kvtransfer.create_sender("ucx", src, token=TOKEN) as sender:
        _send(sender, address, "here")
    peer.call("wait", "here", 15.0)
    assert peer.call("read", 1, DST) == block_bytes(src, 1, SRC)
    assert peer.call("metrics")["peers_refused"] == 0


# ---- the pure parts ----------------------------------------------------------------------

def test_allowed_addresses():
    assert allowed_addresses("127.0.0.1", None) == {"127.0.0.1"}
    assert allowed_addresses("10.0.0.3", "127.0.0.2") == {"127.0.0.2"}
    assert allowed_addresses("127.0.0.1", "any") is None
    assert allowed_addresses("0.0.0.0", None) is None
    assert "127.0.0.1" in allowed_addresses("localhost", None)
    with pytest.raises(ValueError, match="KV interface 'no-such-host.invalid' does not resolve"):
        allowed_addresses("no-such-host.invalid", None)


def test_address_allowed():
    allowed = frozenset({"127.0.0.2"})
    assert address_allowed("127.0.0.2", allowed)
    assert address_allowed("::ffff:127.0.0.2", allowed)
    assert not address_allowed("127.0.0.1", allowed)
    assert not address_allowed(None, allowed)  # UCX could not tell: refused
    assert address_allowed(None, None)


def test_proofs_bind_token_nonces_direction_and_layout():
    sn, cn = new_nonce(), new_nonce()
    assert len(sn) == NONCE_BYTES and sn != cn
    proof = sender_proof(TOKEN, sn, cn, 42)
    assert len(proof) == PROOF_BYTES and verify(proof, sender_proof(TOKEN, sn, cn, 42))
    others = [sender_proof(OTHER, sn, cn, 42), sender_proof(TOKEN, new_nonce(), cn, 42),
              sender_proof(TOKEN, sn, new_nonce(), 42), sender_proof(TOKEN, sn, cn, 43),
              receiver_proof(TOKEN, sn, cn, 42)]
    assert not any(verify(proof, other) for other in others)
    assert not verify(proof, proof[:-1])
