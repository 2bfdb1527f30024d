import threading

import pytest
import torch

from pdserve import kvtransfer
from pdserve.kvtransfer import KVTransferError, KVTransferTimeout
from kvx_peer import CacheSpec, make_caches

SPEC = CacheSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)


@pytest.fixture
def pair():
    src, dst = make_caches(SPEC, seed=1), make_caches(SPEC, seed=2)
    receiver = kvtransfer.create_receiver("fake", dst)
    sender = kvtransfer.create_sender("fake", src)
    yield src, dst, sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.timeout(20)
def test_fake_transfer_lands_exact_blocks(pair):
    src, dst, sender, receiver = pair
    before = [(k.clone(), v.clone()) for k, v in dst]
    src_ids, dst_ids = [9, 2, 14, 5], [3, 11, 0, 7]
    receiver.expect("req-1", dst_ids, 3, deadline_s=10)
    for layer in range(3):
        sender.send_layer(receiver.address(), "req-1", layer, src_ids, dst_ids)
    sent = sender.finish("req-1", timeout=10)
    got = receiver.wait("req-1", timeout=10)
    assert got.num_bytes == sent.num_bytes == 3 * 2 * 4 * (4 * 2 * 8 * 4)
    untouched = [b for b in range(16) if b not in dst_ids]
    for layer in range(3):
        for pool in range(2):
            assert torch.equal(dst[layer][pool][dst_ids], src[layer][pool][src_ids])
            assert torch.equal(dst[layer][pool][untouched], before[layer][pool][untouched])
    assert receiver.metrics()["transfers_completed"] == 1
    assert sender.metrics()["messages_sent"] == 3


@pytest.mark.timeout(20)
def test_fake_chunks_cover_blocks(pair):
    src, dst, sender, receiver = pair
    receiver.expect("req-2", [1, 2, 3, 4], 2, deadline_s=10)
    for layer in range(2):
        sender.send_layer(receiver.address(), "req-2", layer, [5, 6], [1, 2])
    with pytest.raises(KVTransferTimeout, match="stays expected"):
        receiver.wait("req-2", timeout=0.2)
    for layer in range(2):
        sender.send_layer(receiver.address(), "req-2", layer, [7, 8], [3, 4])
    receiver.wait("req-2", timeout=10)
    sender.finish("req-2", timeout=10)
    for layer in range(2):
        assert torch.equal(dst[layer][1][[1, 2, 3, 4]], src[layer][1][[5, 6, 7, 8]])


@pytest.mark.timeout(20)
def test_fake_deadline_drops_late_data(pair):
    src, dst, sender, receiver = pair
    before = [(k.clone(), v.clone()) for k, v in dst]
    receiver.expect("late", [0, 1], 3, deadline_s=0.1)
    with pytest.raises(KVTransferTimeout, match="deadline"):
        receiver.wait("late", timeout=5)
    for layer in range(3):
        sender.send_layer(receiver.address(), "late", layer, [4, 5], [0, 1])
    with pytest.raises(KVTransferError, match="deadline_passed"):
        sender.finish("late", timeout=5)
    for layer in range(3):
        assert torch.equal(dst[layer][0], before[layer][0])
    # The first late message is dropped; once the sender hears of it, it skips the rest (how
    # many it skips depends on thread timing, not on correctness).
    dropped, skipped = receiver.metrics()["messages_dropped"], sender.metrics()["messages_skipped"]
    assert dropped >= 1 and dropped + skipped <= 3
    assert receiver.metrics()["transfers_expired"] == 1


@pytest.mark.timeout(20)
def test_fake_cancel_and_bad_ids(pair):
    src, dst, sender, receiver = pair
    receiver.expect("c", [0, 1], 1, deadline_s=10)
    receiver.cancel("c")
    sender.send_layer(receiver.address(), "c", 0, [4, 5], [0, 1])
    with pytest.raises(KVTransferError, match="cancelled"):
        sender.finish("c", timeout=5)
    receiver.expect("bad", [0, 1], 1, deadline_s=10)
    sender.send_layer(receiver.address(), "bad", 0, [4, 5], [0, 2])  # block 2 not reserved
    with pytest.raises(KVTransferError, match="not reserved"):
        receiver.wait("bad", timeout=5)
    with pytest.raises(ValueError, match="duplicate"):
        sender.send_layer(receiver.address(), "x", 0, [1, 1], [2, 3])
    with pytest.raises(ValueError, match="out of range"):
        sender.send_layer(receiver.address(), "x", 0, [99], [2])
    with pytest.raises(ValueError, match="out of range"):
        receiver.expect("y", [16], 1, deadline_s=1)


@pytest.mark.timeout(20)
def test_fake_layout_mismatch():
    src = make_caches(CacheSpec(head_dim=8), seed=1)
    dst = make_caches(CacheSpec(head_dim=16), seed=None)
    with kvtransfer.create_receiver("fake", dst) as receiver, kvtransfer.create_sender("fake", src) as sender:
        receiver.expect("m", [0], 3, deadline_s=5)
        sender.send_layer(receiver.address(), "m", 0, [0], [0])
        with pytest.raises(KVTransferError, match="layout mismatch"):
            sender.finish("m", timeout=5)
        assert receiver.metrics()["handshake_errors"] == 1


@pytest.mark.timeout(20)
def test_fake_model_mismatch_refused_at_handshake():
    src = make_caches(SPEC, seed=1)
    dst = make_caches(SPEC, seed=None)
    with kvtransfer.create_receiver("fake", dst, model="a/model") as receiver, \
            kvtransfer.create_sender("fake", src, model="b/model") as sender:
        receiver.expect("m", [0], SPEC.num_layers, deadline_s=5)
        sender.send_layer(receiver.address(), "m", 0, [0], [0])
        with pytest.raises(KVTransferError, match="model mismatch: peer serves 'a/model', this process 'b/model'"):
            sender.finish("m", timeout=5)
        assert receiver.metrics()["handshake_errors"] == 1
    assert all(not pool.any() for pair in dst for pool in pair)  # nothing landed


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown KV transfer backend 'nope'"):
        kvtransfer.create_sender("nope", make_caches(SPEC, None))
    with pytest.raises(TypeError, match="bogus"):
        kvtransfer.create_sender("fake", make_caches(SPEC, None), bogus=1)


@pytest.mark.timeout(10)
def test_fake_close_is_idempotent_and_joins():
    sender = kvtransfer.create_sender("fake", make_caches(SPEC, None))
    sender.close()
    sender.close()
    assert not [t for t in threading.enumerate() if t.name == "kvtransfer-fake-sender" and t.is_alive()]
    with pytest.raises(KVTransferError, match="closed"):
        sender.send_layer("fake://0", "t", 0, [0], [0])
