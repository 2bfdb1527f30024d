"""Faults injected in the UCX sender (kvtransfer.faults): a lost, duplicated, reordered or
corrupted message never makes a transfer land wrong bytes. Each transfer either lands exactly
the source blocks or fails with an error on both sides (and then its blocks are not used)."""

from __future__ import annotations

import pytest
import torch

from pdserve import kvtransfer
from pdserve.kvtransfer import KVTransferCorrupt, KVTransferError, KVTransferTimeout
from pdserve.kvtransfer.faults import FaultInjector, parse_faults
from kvx_peer import CacheSpec, Peer, PeerError, make_caches

SPEC = CacheSpec(num_layers=4, num_blocks=32, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


@pytest.fixture(scope="module")
def peer():
    peer = Peer()
    yield peer
    assert peer.stop() == 0, "peer process did not exit cleanly"


def test_fault_spec_parsing():
    spec = parse_faults("drop=0.1, corrupt=0.2,seed=3")
    assert (spec.drop, spec.corrupt, spec.duplicate, spec.seed) == (0.1, 0.2, 0.0, 3)
    with pytest.raises(ValueError, match="'lose=0.1' is not one of"):
        parse_faults("lose=0.1")
    with pytest.raises(ValueError, match="probability must be in"):
        parse_faults("drop=2")
    with pytest.raises(ValueError, match="more than 1"):
        parse_faults("drop=0.6,corrupt=0.6")
    draws = [FaultInjector("drop=0.5,seed=1").draw() for _ in range(1)]
    assert draws == [FaultInjector("drop=0.5,seed=1").draw()]  # seeded: reproducible


def _transfer(peer, sender, address, tid, src_ids, dst_ids, deadline=1.5):
    """(landed on the receiver, what each side raised)."""
    peer.call("expect", tid, dst_ids, SPEC.num_layers, deadline)
    for layer in range(SPEC.num_layers):
        sender.send_layer(address, tid, layer, src_ids, dst_ids)
    sent_error = None
    try:
        sender.finish(tid, timeout=deadline + 2)
    except KVTransferError as e:
        sent_error = e
    try:
        peer.call("wait", tid, deadline + 2)
        return True, sent_error, None
    except PeerError as e:
        return False, sent_error, e


def _read(peer, dst_ids):
    after = peer.call("read_all")
    out = []
    for layer in range(SPEC.num_layers):
        for pool in range(2):
            raw = torch.frombuffer(bytearray(after[layer][pool]), dtype=torch.float32).view(SPEC.num_blocks, 4, 2, 8)
            out.append(raw[dst_ids])
    return out


def _expected(src, src_ids):
    return [src[layer][pool][src_ids] for layer in range(SPEC.num_layers) for pool in range(2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["corrupt", "drop"])
def test_lost_or_corrupt_messages_fail_the_transfer_and_land_nothing(peer, kind):
    src = make_caches(SPEC, seed=5)
    address = peer.call("open_receiver", SPEC)
    with kvtransfer.create_sender("ucx", src, faults=f"{kind}=1.0,seed=1") as sender:
        landed, sent_error, recv_error = _transfer(peer, sender, address, f"{kind}-1", [1, 2, 3], [4, 5, 6])
        assert not landed
        if kind == "corrupt":
            assert isinstance(sent_error, KVTransferCorrupt), sent_error
            assert recv_error.type_name == "KVTransferCorrupt" and "failed its checksum" in recv_error.message
            assert peer.call("metrics")["checksum_failures"] >= 1
        else:
            assert isinstance(sent_error, KVTransferTimeout), sent_error
            assert recv_error.type_name == "KVTransferTimeout"
        assert sender.metrics()["faults_injected"] >= 1
    zeros = make_caches(SPEC, seed=None)
    assert all(torch.equal(got, want) for got, want in zip(_read(peer, [4, 5, 6]), _expected(zeros, [4, 5, 6])))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["duplicate", "reorder"])
def test_duplicated_or_reordered_messages_still_land_exactly(peer, kind):
    src = make_caches(SPEC, seed=6)
    address = peer.call("open_receiver", SPEC)
    with kvtransfer.create_sender("ucx", src, faults=f"{kind}=1.0,seed=1") as sender:
        for n in range(3):
            src_ids, dst_ids = [n, n + 7, n + 14], [20 + n, 10 + n, n]
            landed, sent_error, recv_error = _transfer(peer, sender, address, f"{kind}-{n}", src_ids, dst_ids, 10.0)
            assert landed and sent_error is None and recv_error is None
            assert all(torch.equal(a, b) for a, b in zip(_read(peer, dst_ids), _expected(src, src_ids)))
        assert sender.metrics()["faults_injected"] >= 3


@pytest.mark.timeout(240)
def test_mixed_faults_never_land_wrong_bytes(peer):
    src = make_caches(SPEC, seed=7)
    address = peer.call("open_receiver", SPEC)
    outcomes = {"landed": 0, "failed": 0}
    with kvtransfer.create_sender("ucx", src,
                                  faults="drop=0.05,duplicate=0.1,reorder=0.1,corrupt=0.1,seed=4") as sender:
        for n in range(12):
            src_ids = [(n + 3 * i) % SPEC.num_blocks for i in range(3)]
            dst_ids = [(5 * n + i) % SPEC.num_blocks for i in range(3)]
            landed, sent_error, recv_error = _transfer(peer, sender, address, f"mixed-{n}", src_ids, dst_ids)
            if landed:
                assert sent_error is None
                assert all(torch.equal(a, b) for a, b in zip(_read(peer, dst_ids), _expected(src, src_ids)))
                outcomes["landed"] += 1
            else:  # the receiver refused it: its waiter (the decode worker) never uses those blocks
                assert sent_error is not None and recv_error is not None
                outcomes["failed"] += 1
        assert sender.metrics()["faults_injected"] > 0
    assert outcomes["landed"] > 0 and outcomes["failed"] > 0, outcomes
