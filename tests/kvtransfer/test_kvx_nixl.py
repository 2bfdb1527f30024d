"""NIXL backend between two processes over loopback (NIXL's UCX plugin: TCP / shared memory).

Skipped, with the import error as the reason, where NIXL is not installed (the ``nixl`` extra,
not part of ``make setup``).
"""

import threading
import time
from dataclasses import replace

import pytest
import torch

from pdserve import kvtransfer
from pdserve.kvtransfer import KVTransferError, KVTransferTimeout
from pdserve.kvtransfer.errors import KVTransferError as _Err
from kvx_peer import CacheSpec, Peer, PeerError, block_bytes, make_caches


def _nixl_missing() -> str | None:
    from pdserve.kvtransfer.nixl import load_nixl

    try:
        load_nixl()
    except _Err as e:
        return str(e)
    return None


_MISSING = _nixl_missing()
pytestmark = [pytest.mark.timeout(90), pytest.mark.skipif(_MISSING is not None, reason=f"{_MISSING}")]

FP32 = CacheSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
BF16 = CacheSpec(num_layers=3, num_blocks=12, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                 stacked=True)


@pytest.fixture(scope="module")
def peer():
    peer = Peer()
    peer.call("use_backend", "nixl")
    yield peer
    assert peer.stop() == 0, "peer process did not exit cleanly"


def nixl_threads():
    return [t for t in threading.enumerate() if t.name.startswith("kvtransfer-nixl") and t.is_alive()]


def wait_for(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.01)


def pools_after(peer, spec=FP32):
    """The receiver's pools as they are now: [layer][K, V] tensors [blocks, block_size, heads, head_dim]."""
    after = peer.call("read_all")
    shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [[torch.frombuffer(bytearray(after[layer][pool]), dtype=getattr(torch, spec.dtype)).view(shape)
             for pool in range(2)] for layer in range(spec.num_layers)]


def test_nixl_is_a_registered_backend():
    assert "nixl" in kvtransfer.available_backends()


@pytest.mark.parametrize("op", ["direct", "write", "read"])
def test_nixl_fp32_lands_exact_blocks(peer, op):
    src = make_caches(FP32, seed=11)
    address = peer.call("open_receiver", FP32)
    assert address.startswith("nixl://127.0.0.1:")
    src_ids, dst_ids = [9, 2, 14, 5, 0], [3, 11, 0, 7, 15]
    with kvtransfer.create_sender("nixl", src, op=op) as sender:
        for n in range(2):  # a second transfer reuses the connection
            transfer_id = f"fp32-{n}"
            peer.call("expect", transfer_id, dst_ids, 3, 20.0)
            for layer in range(3):
                sender.send_layer(address, transfer_id, layer, src_ids, dst_ids)
            sent = sender.finish(transfer_id, timeout=20)
            landed = peer.call("wait", transfer_id, 20.0)
            assert sent.num_bytes == landed.num_bytes == 3 * 2 * 5 * FP32.block_size * 2 * 8 * 4
        assert sender.metrics()["transfers_completed"] == 2
    after = pools_after(peer)
    zeros = make_caches(FP32, seed=None)
    for layer in range(3):
        for pool in range(2):
            raw = after[layer][pool]
            assert torch.equal(raw[dst_ids], src[layer][pool][src_ids])
            untouched = [b for b in range(16) if b not in dst_ids]
            assert torch.equal(raw[untouched], zeros[layer][pool][untouched])
    metrics = peer.call("metrics")
    assert metrics["transfers_completed"] == 2 and metrics["messages_dropped"] == 0
    if op == "direct":  # one WRITE may carry several layers (one frame each run of layers)
        assert 2 <= metrics["messages_direct"] <= 6 and metrics["messages_written"] == metrics["messages_pulled"] == 0
    else:
        assert metrics["messages_written" if op == "write" else "messages_pulled"] == 6


def test_nixl_write_splits_a_layer_over_slots_and_waits_for_credits(peer):
    """A receiver offering one slot of two blocks: each 5-block layer goes in three WRITEs, each
    waiting for the slot to come back; the blocks land exactly."""
    block = FP32.block_size * 2 * 8 * 4  # one block's K (or V) bytes
    peer.call("setenv", "PDSERVE_NIXL_SLOT_BYTES", str(2 * 2 * block))
    peer.call("setenv", "PDSERVE_NIXL_SLOTS", "1")
    try:
        address = peer.call("open_receiver", FP32)
        src = make_caches(FP32, seed=12)
        src_ids, dst_ids = [4, 8, 1, 13, 6], [2, 9, 12, 5, 1]
        with kvtransfer.create_sender("nixl", src, op="write") as sender:
            peer.call("expect", "split", dst_ids, 3, 20.0)
            for layer in range(3):
                sender.send_layer(address, "split", layer, src_ids, dst_ids)
            sender.finish("split", timeout=20)
            peer.call("wait", "split", 20.0)
        after = pools_after(peer)
        for layer in range(3):
            for pool in range(2):
                raw = after[layer][pool]
                assert torch.equal(raw[dst_ids], src[layer][pool][src_ids])
        assert peer.call("metrics")["messages_written"] == 9
    finally:
        peer.call("setenv", "PDSERVE_NIXL_SLOT_BYTES", None)
        peer.call("setenv", "PDSERVE_NIXL_SLOTS", None)


def test_nixl_bad_slot_environment_is_refused_by_name():
    """Read at the process's edge (kvtransfer.settings); the staging takes what was read there."""
    from pdserve.kvtransfer import settings
    from pdserve.kvtransfer.nixl.receiver import _slot_config

    with pytest.raises(ValueError, match="PDSERVE_NIXL_SLOTS must be an int >= 1, got 'zero'"):
        settings.KVSettings.from_environment({"PDSERVE_NIXL_SLOTS": "zero"})
    before = settings.current()
    try:
        settings.configure(settings.KVSettings.from_environment({"PDSERVE_NIXL_SLOTS": "2",
                                                                 "PDSERVE_NIXL_SLOT_BYTES": "4096"}))
        assert _slot_config() == (4096, 2)
    finally:
        settings.configure(before)


def test_nixl_bf16_child_sends_to_parent_in_chunks():
    """Stacked pools (one allocation, as the engine makes them), two chunks per layer."""
    peer = Peer()
    try:
        peer.call("use_backend", "nixl")
        dst = make_caches(BF16, seed=None)
        src_ids, dst_ids = [1, 10, 4], [8, 2, 5]
        with kvtransfer.create_receiver("nixl", dst) as receiver:
            receiver.expect("bf16", dst_ids, 3, deadline_s=20)
            peer.call("open_sender", BF16, 22)
            for layer in range(3):
                peer.call("send_layer", receiver.address(), "bf16", layer, src_ids[:2], dst_ids[:2])
                peer.call("send_layer", receiver.address(), "bf16", layer, src_ids[2:], dst_ids[2:])
            result = receiver.wait("bf16", timeout=20)
            assert peer.call("finish", "bf16", 20.0).num_bytes == result.num_bytes
        src = make_caches(BF16, seed=22)
        for layer in range(3):
            assert block_bytes(dst, layer, dst_ids) == block_bytes(src, layer, src_ids)
            others = [b for b in range(12) if b not in dst_ids]
            assert not dst[layer][0][others].any() and not dst[layer][1][others].any()
    finally:
        assert peer.stop() == 0


@pytest.mark.parametrize("op", ["direct", "write", "read"])
def test_nixl_nack_on_unknown_id_and_unreserved_blocks(peer, op):
    src = make_caches(FP32, seed=3)
    zeros = make_caches(FP32, seed=None)
    address = peer.call("open_receiver", FP32)
    with kvtransfer.create_sender("nixl", src, op=op) as sender:
        sender.send_layer(address, "never-expected", 0, [1], [2])
        with pytest.raises(KVTransferError, match="unknown_transfer"):
            sender.finish("never-expected", timeout=10)
        peer.call("expect", "reserved", [4, 5], 3, 20.0)
        sender.send_layer(address, "reserved", 0, [1, 2], [4, 6])  # block 6 is not reserved
        with pytest.raises(KVTransferError, match="bad_message"):
            sender.finish("reserved", timeout=10)
        with pytest.raises(PeerError, match="KVTransferError"):
            peer.call("wait", "reserved", 10.0)
        # the connection stays in sync: the next transfer on it lands
        peer.call("expect", "next", [6], 3, 20.0)
        for layer in range(3):
            sender.send_layer(address, "next", layer, [3], [6])
        sender.finish("next", timeout=20)
        peer.call("wait", "next", 20.0)
        assert peer.call("read", 2, [6]) == block_bytes(src, 2, [3])
    if op != "direct":  # a DIRECT sender has already written the ids it was given; the others never do
        for ids in ([2], [4, 5]):
            assert peer.call("read", 0, ids) == block_bytes(zeros, 0, ids)
    assert peer.call("metrics")["messages_dropped"] == 2


def _transfer(peer, sender, address, transfer_id, src_ids, dst_ids):
    """One whole transfer of FP32's three layers, landed on both sides."""
    peer.call("expect", transfer_id, dst_ids, 3, 20.0)
    for layer in range(3):
        sender.send_layer(address, transfer_id, layer, src_ids, dst_ids)
    sender.finish(transfer_id, timeout=20)
    peer.call("wait", transfer_id, 20.0)


def _warm_direct_link(peer, sender, address, src):
    """One transfer, so that the DIRECT sender is connected before the test's fence."""
    _transfer(peer, sender, address, "warm", [1], [0])
    assert peer.call("read", 1, [0]) == block_bytes(src, 1, [1])


def test_nixl_direct_cancel_fences_the_sender(peer):
    """A cancelled transfer's blocks go back only once every DIRECT sender is fenced: the sender
    then drops what it is given for the transfer, and its finish says why."""
    src = make_caches(FP32, seed=41)
    zeros = make_caches(FP32, seed=None)
    address = peer.call("open_receiver", FP32)
    with kvtransfer.create_sender("nixl", src, op="direct") as sender:
        _warm_direct_link(peer, sender, address, src)
        peer.call("expect", "gone", [8, 9], 3, 20.0)
        peer.call("cancel", "gone")
        for layer in range(3):
            sender.send_layer(address, "gone", layer, [2, 3], [8, 9])
        with pytest.raises(KVTransferError, match="cancelled"):
            sender.finish("gone", timeout=10)
        _transfer(peer, sender, address, "after", [4], [10])  # the link stays up: the next transfer lands
    for layer in range(3):
        assert peer.call("read", layer, [8, 9]) == block_bytes(zeros, layer, [8, 9])
        assert peer.call("read", layer, [10]) == block_bytes(src, layer, [4])
    metrics = peer.call("metrics")
    assert metrics["fences"] == 1 and metrics["fence_timeouts"] == 0 and metrics["transfers_cancelled"] == 1


def test_nixl_direct_sender_that_ignores_a_fence_is_disconnected(peer, monkeypatch):
    from pdserve.kvtransfer.nixl import NixlSender

    monkeypatch.setattr(NixlSender, "_serve_fences", lambda self, link: None)
    src = make_caches(FP32, seed=42)
    address = peer.call("open_receiver", FP32, fence_timeout=0.5)
    with kvtransfer.create_sender("nixl", src, op="direct") as sender:
        _warm_direct_link(peer, sender, address, src)
        peer.call("expect", "ignored", [5], 3, 20.0)
        started = time.monotonic()
        peer.call("cancel", "ignored")
        assert 0.4 < time.monotonic() - started < 5
        metrics = peer.call("metrics")
        assert metrics["fences"] == 1 and metrics["fence_timeouts"] == 1
        wait_for(lambda: sender._links[address].error is not None)  # the receiver hung up
        sender.send_layer(address, "late", 0, [1], [6])
        with pytest.raises(KVTransferError, match="closed the connection"):
            sender.finish("late", timeout=10)
    assert peer.call("read", 0, [6]) == block_bytes(make_caches(FP32, seed=None), 0, [6])


@pytest.mark.parametrize("op", ["write", "direct"])
def test_nixl_deadline_drops_late_data(peer, op):
    """DIRECT: the sender connects after the receiver fenced the expired transfer, and is told at
    handshake."""
    src = make_caches(FP32, seed=33)
    zeros = make_caches(FP32, seed=None)
    address = peer.call("open_receiver", FP32)
    with kvtransfer.create_sender("nixl", src, op=op) as sender:
        peer.call("expect", "later", [8, 9], 3, 0.3)
        with pytest.raises(PeerError, match="KVTransferTimeout"):
            peer.call("wait", "later", 10.0)
        for layer in range(3):
            sender.send_layer(address, "later", layer, [1, 2], [8, 9])
        with pytest.raises(KVTransferTimeout, match="deadline_passed"):
            sender.finish("later", timeout=10)
    for layer in range(3):
        assert peer.call("read", layer, [8, 9]) == block_bytes(zeros, layer, [8, 9])
    assert peer.call("metrics")["transfers_expired"] == 1


def test_nixl_layout_mismatch_rejected_at_handshake(peer):
    address = peer.call("open_receiver", FP32)
    other = CacheSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=16)
    with kvtransfer.create_sender("nixl", make_caches(other, seed=1)) as sender:
        peer.call("expect", "mismatch", [0], 3, 5.0)
        sender.send_layer(address, "mismatch", 0, [0], [0])
        with pytest.raises(KVTransferError, match="layout mismatch"):
            sender.finish("mismatch", timeout=10)
    assert peer.call("metrics")["handshake_errors"] == 1
    assert peer.call("read", 0, [0]) == block_bytes(make_caches(FP32, None), 0, [0])


def test_nixl_model_and_wire_version_mismatch_rejected(peer):
    try:
        address = peer.call("open_receiver", FP32, model="org/decode-model")
        with kvtransfer.create_sender("nixl", make_caches(FP32, seed=1), model="org/prefill-model") as sender:
            sender.send_layer(address, "model", 0, [0], [0])
            with pytest.raises(KVTransferError, match="model mismatch: peer serves 'org/decode-model'"):
                sender.finish("model", timeout=10)
        address = peer.call("open_receiver", FP32, 99)
        with kvtransfer.create_sender("nixl", make_caches(FP32, seed=1)) as sender:
            sender.send_layer(address, "v", 0, [0], [0])
            with pytest.raises(KVTransferError, match="version mismatch"):
                sender.finish("v", timeout=10)
        assert peer.call("metrics")["handshake_errors"] == 1
    finally:
        peer.call("open_receiver", FP32)


def test_nixl_restarted_receiver_refuses_old_address(peer):
    old = peer.call("open_receiver", FP32)
    host_port = old.rsplit("/", 1)[0]
    new = peer.call("open_receiver", FP32, port=int(host_port.rsplit(":", 1)[1]))
    assert new != old and new.rsplit("/", 1)[0] == host_port
    with kvtransfer.create_sender("nixl", make_caches(FP32, seed=1)) as sender:
        sender.send_layer(old, "stale", 0, [0], [0])
        with pytest.raises(KVTransferError, match="restarted"):
            sender.finish("stale", timeout=10)


def test_nixl_unknown_option_and_bad_arguments():
    caches = make_caches(FP32, seed=1)
    with pytest.raises(TypeError, match="coalesce_bytes"):
        kvtransfer.create_sender("nixl", caches, coalesce_bytes=1 << 20)
    with pytest.raises(ValueError, match="pacer must be a kvtransfer.pacing.LinkPacer"):
        kvtransfer.create_sender("nixl", caches, pacer="10.0.0.1=1")
    with kvtransfer.create_sender("nixl", caches) as sender:
        with pytest.raises(ValueError, match="not a NIXL KV address"):
            sender.send_layer("ucx://127.0.0.1:1", "t", 0, [0], [0])
        with pytest.raises(ValueError, match="out of range"):
            sender.send_layer("nixl://127.0.0.1:1/1", "t", 0, [99], [0])


def test_nixl_close_leaves_no_thread(peer):
    address = peer.call("open_receiver", FP32)
    for round in range(2):
        sender = kvtransfer.create_sender("nixl", make_caches(FP32, seed=5))
        peer.call("expect", f"bye-{round}", [1], 3, 20.0)
        for layer in range(3):
            sender.send_layer(address, f"bye-{round}", layer, [2], [1])
        sender.finish(f"bye-{round}", timeout=20)
        peer.call("wait", f"bye-{round}", 20.0)
        sender.close()
        sender.close()
        assert nixl_threads() == []
    peer.call("close")
    assert not [t for t in peer.call("threads") if t.startswith("kvtransfer-nixl")]


# ---- the cluster token and the interface (the control connection's opening, before HELLO) ----

TOKEN, OTHER = "nixl-cluster-secret", "another-cluster"
AUTH_SRC, AUTH_DST = [1, 4, 6], [2, 5, 9]


def _send_all(sender, address, transfer_id):
    for layer in range(3):
        sender.send_layer(address, transfer_id, layer, AUTH_SRC, AUTH_DST)
    return sender.finish(transfer_id, timeout=15)


def _refusals(peer, expected=1):
    end = time.monotonic() + 10
    while (metrics := peer.call("metrics"))["peers_refused"] < expected and time.monotonic() < end:
        time.sleep(0.05)
    return metrics


@pytest.mark.parametrize("sender_token", [None, OTHER], ids=["no-token", "wrong-token"])
def test_nixl_receiver_with_token_refuses_a_sender_without_it(peer, sender_token):
    address = peer.call("open_receiver", FP32, token=TOKEN)
    peer.call("expect", "refused", AUTH_DST, 3, 10.0)
    with kvtransfer.create_sender("nixl", make_caches(FP32, seed=1), token=sender_token) as sender:
        with pytest.raises(KVTransferError, match="KV peer refused: cluster token mismatch"):
            _send_all(sender, address, "refused")
    metrics = _refusals(peer)
    assert metrics["peers_refused"] == 1 and metrics.get("messages_pulled", 0) == 0
    zeros = make_caches(FP32, seed=None)
    assert all(peer.call("read", layer, AUTH_DST) == block_bytes(zeros, layer, AUTH_DST) for layer in range(3))


def test_nixl_sender_with_token_refuses_a_receiver_without_it(peer):
    address = peer.call("open_receiver", FP32)
    with kvtransfer.create_sender("nixl", make_caches(FP32, seed=1), token=TOKEN) as sender:
        with pytest.raises(KVTransferError, match="KV peer refused: cluster token mismatch: the receiver has no"):
            _send_all(sender, address, "untokened")


@pytest.mark.parametrize("interface", [None, "127.0.0.1", "any"])
def test_nixl_matching_tokens_land_exact_bytes(peer, interface):
    address = peer.call("open_receiver", FP32, host="127.0.0.1", interface=interface, token=TOKEN)
    src = make_caches(FP32, seed=8)
    peer.call("expect", "tokened", AUTH_DST, 3, 15.0)
    with kvtransfer.create_sender("nixl", src, token=TOKEN) as sender:
        _send_all(sender, address, "tokened")
    peer.call("wait", "tokened", 15.0)
    for layer in range(3):
        assert peer.call("read", layer, AUTH_DST) == block_bytes(src, layer, AUTH_SRC)
    assert peer.call("metrics")["peers_refused"] == 0


def test_nixl_connection_on_another_interface_is_refused(peer):
    """The control listener binds 127.0.0.1; a receiver told to serve 127.0.0.2 only refuses what
    arrives there, before the handshake."""
    address = peer.call("open_receiver", FP32, host="127.0.0.1", interface="127.0.0.2")
    with kvtransfer.create_sender("nixl", make_caches(FP32, seed=1)) as sender:
        with pytest.raises(KVTransferError, match="KV peer refused: connection arrived on an interface"):
            _send_all(sender, address, "elsewhere")
    assert _refusals(peer)["peers_refused"] == 1


def _count_descriptors(sender, counts):
    """Record the local descriptor count of every transfer the sender posts (NIXL's own lists)."""
    agent = sender._agent
    make = agent.get_xfer_descs

    def counting(descs, mem_type=None, *args, **kwargs):
        counts.append(len(descs))
        return make(descs, mem_type, *args, **kwargs)

    agent.get_xfer_descs = counting


@pytest.mark.parametrize("op, src_ids, dst_ids", [
    ("write", [15, 3, 9, 0, 6], [1, 12, 4, 14, 7]),  # scattered
    ("direct", [2, 3, 4, 5, 9], [8, 9, 10, 11, 0]),  # two runs: 2-5 onto 8-11, 9 onto 0
])
def test_nixl_descriptors_per_write(peer, op, src_ids, dst_ids):
    """The staged WRITE gathers scattered blocks on the sender: one local and one remote descriptor
    per WRITE (per-block descriptors are what made NIXL slow on a GPU). DIRECT: a descriptor per
    run of consecutive blocks, K and V."""
    src = make_caches(FP32, seed=51)
    address = peer.call("open_receiver", FP32)
    counts = []
    with kvtransfer.create_sender("nixl", src, op=op) as sender:
        _count_descriptors(sender, counts)
        _transfer(peer, sender, address, f"descriptors-{op}", src_ids, dst_ids)
    if op == "write":
        assert counts == [1] * 6  # three WRITEs, a local and a remote list each
    else:
        assert sum(counts) == 2 * 3 * 4 and all(c % 4 == 0 for c in counts)  # both lists, 3 layers, 2 runs x K, V
    for layer in range(3):
        assert peer.call("read", layer, dst_ids) == block_bytes(src, layer, src_ids)


CUDA_SPEC = CacheSpec(num_layers=3, num_blocks=48, block_size=16, num_kv_heads=8, head_dim=128,
                      dtype="bfloat16", device="cuda", stacked=True)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["direct", "write"])
def test_nixl_cuda_blocks_land_exact_while_the_sending_stream_is_busy(peer, op):
    """CUDA pools, sent as a prefill sends them: each layer's kernels (a short GPU sleep here),
    then `send_layer`, then the next layers' kernels (a long one) on the same stream. The
    sender's own work must not wait behind those or read anything that does: every block
    lands exact. (The staged WRITE once uploaded its gather index on that stream and gathered
    on its own: on a GPU its first pdserve up run hit a device-side assert, index out of
    bounds, in the prefill worker.)"""
    src = make_caches(CUDA_SPEC, seed=46)
    address = peer.call("open_receiver", replace(CUDA_SPEC, num_blocks=40))
    transfers = [([47, 3, 20, 9], [0, 39, 8, 21]), ([33, 12, 1, 46], [5, 30, 11, 12])]  # new ids each
    with kvtransfer.create_sender("nixl", src, op=op) as sender:
        for n, (src_ids, dst_ids) in enumerate(transfers):
            transfer_id = f"busy-send-{op}-{n}"
            peer.call("expect", transfer_id, dst_ids, 3, 30.0)
            for layer in range(3):
                torch.cuda._sleep(5_000_000)  # the layer's own kernels: the send waits for them
                sender.send_layer(address, transfer_id, layer, src_ids, dst_ids)
                torch.cuda._sleep(100_000_000)  # the next layers': the send must not
            sender.finish(transfer_id, timeout=30)
            peer.call("wait", transfer_id, 30.0)
    torch.cuda.synchronize()
    for src_ids, dst_ids in transfers:
        for layer in range(3):
            assert peer.call("read", layer, dst_ids) == block_bytes(src, layer, src_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["write", "read"])
def test_nixl_cuda_landing_does_not_wait_for_the_receiving_engine_stream(peer, op):
    """The staged modes copy each message into the pools on landing. With the receiver's engine
    stream busy (a decode worker's steps; one long GPU sleep here), a transfer still lands: the
    copies run on the receiver's own stream. (On the engine's stream every landing waited for
    the decode steps queued ahead of it: 0.3 GB/s in pdserve up on an H200.)"""
    src = make_caches(CUDA_SPEC, seed=47)
    address = peer.call("open_receiver", replace(CUDA_SPEC, num_blocks=40))
    with kvtransfer.create_sender("nixl", src, op=op) as sender:
        _transfer(peer, sender, address, f"warm-{op}", [5], [6])  # connected and staged before the busy window
        peer.call("busy_stream", 4_000_000_000)  # ~2 s
        _transfer(peer, sender, address, f"busy-recv-{op}", [40, 7, 19], [2, 33, 17])
        assert peer.call("stream_busy"), "the transfer landed only after the engine's stream ran dry"
    deadline = time.monotonic() + 30
    while peer.call("stream_busy"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for layer in range(3):
        assert peer.call("read", layer, [2, 33, 17]) == block_bytes(src, layer, [40, 7, 19])


@pytest.mark.parametrize("op", ["write", "direct", "read"])
def test_nixl_fp8_wire_goes_on_the_staged_write(peer, op):
    """precision="fp8": the staged WRITE quantizes each slot after its gather and the receiver
    lands the FP8 round trip of the source blocks (kernels.kv_quant) in the FP8 wire's bytes;
    DIRECT and READ move the pools' bytes as they are (exact, full-precision bytes)."""
    from pdserve.kernels import kv_codec
    from pdserve.kvtransfer.layout import KVLayout

    src = make_caches(FP32, seed=21)
    address = peer.call("open_receiver", FP32)
    src_ids, dst_ids = [9, 2, 14, 5, 0], [3, 11, 0, 7, 15]
    with kvtransfer.create_sender("nixl", src, op=op) as sender:
        peer.call("expect", "fp8", dst_ids, 3, 20.0)
        for layer in range(3):
            sender.send_layer(address, "fp8", layer, src_ids, dst_ids, precision="fp8")
        sent = sender.finish("fp8", timeout=20)
        landed = peer.call("wait", "fp8", 20.0)
        with pytest.raises(ValueError, match="precision"):
            sender.send_layer(address, "fp4", 0, [0], [1], precision="fp4")
    fp8 = op == "write"
    layout = KVLayout.from_caches(src)
    assert sent.num_bytes == landed.num_bytes == 3 * layout.layer_message_bytes(5, "fp8" if fp8 else "full")
    after = pools_after(peer)
    for layer in range(3):
        for pool in range(2):
            raw = after[layer][pool]
            want = src[layer][pool][src_ids]
            if fp8:
                want = kv_codec.unpack_blocks(kv_codec.pack_blocks(want), torch.float32)
                assert not torch.equal(want, src[layer][pool][src_ids])  # lossy: the test can tell
            assert torch.equal(raw[dst_ids], want)
    assert peer.call("metrics")["messages_dropped"] == 0


@pytest.mark.parametrize("op", ["write", "direct", "read"])
def test_nixl_paced_link_runs_at_its_set_rate_and_reports_it(peer, op):
    """A paced link (kvtransfer.pacing, what launcher.paced's emulated links use): 30 layers of
    98 KB at 0.05 Gbit/s take ~0.45 s, not the unpaced few ms; the blocks land exactly; the bytes
    the bucket held back over phase "link" read the SET rate (what the router measures a paced
    link by); an unpaced transfer reports no "link" phase."""
    from pdserve.kvtransfer.pacing import LinkPacer

    spec = CacheSpec(num_layers=30, num_blocks=8, block_size=16, num_kv_heads=3, head_dim=64)
    rate = 0.05  # 6.25 MB/s: a layer takes ~16 ms, well above a staging slot's round trip here
    address = peer.call("open_receiver", spec)
    src = make_caches(spec, seed=5)
    ids = list(range(4))
    pacer = LinkPacer(burst_bytes=64 << 10)
    pacer.set_link(address, rate_gbps=rate)
    with kvtransfer.create_sender("nixl", src, op=op) as plain:
        peer.call("expect", "plain", ids, 30, 30.0)
        for layer in range(30):
            plain.send_layer(address, "plain", layer, ids, ids)
        unpaced = plain.finish("plain", 20)
        peer.call("wait", "plain", 20.0)
    assert "link" not in unpaced.phases
    with kvtransfer.create_sender("nixl", src, op=op, pacer=pacer) as sender:
        peer.call("expect", "paced", ids, 30, 30.0)
        start = time.monotonic()
        for layer in range(30):
            sender.send_layer(address, "paced", layer, ids, ids)
        paced = sender.finish("paced", 20)
        took = time.monotonic() - start
        peer.call("wait", "paced", 20.0)
        assert sender.metrics()["pacing_delay_seconds"] > 0
    expected_s = (paced.num_bytes - (64 << 10)) * 8 / (rate * 1e9)  # the burst goes at once
    assert took >= 0.9 * expected_s
    # the bucket held back some of it (the rest may have waited for a staging slot's round trip
    # instead): what it held reads the SET rate
    assert paced.link_bytes > 0 and paced.phases["link"] > 0
    assert paced.link_bytes * 8 / paced.phases["link"] / 1e9 == pytest.approx(rate, rel=0.1)
    after = pools_after(peer, spec)
    for layer in (0, 29):
        for pool in range(2):
            raw = after[layer][pool]
            assert torch.equal(raw[ids], src[layer][pool][ids])


@pytest.mark.parametrize("kind", ["corrupt", "drop"])
def test_nixl_corrupt_or_dropped_slots_fail_the_transfer_and_land_nothing(peer, kind):
    """The staged WRITE with faults: a slot flipped after its CRC-32 fails the transfer with NACK
    CORRUPT (the receiver checks every slot on CPU pools); a slot never written leaves it to its
    deadline. Nothing lands either way; a clean sender then lands exactly on the same receiver."""
    from pdserve.kvtransfer import KVTransferCorrupt

    src = make_caches(FP32, seed=31)
    address = peer.call("open_receiver", FP32)
    src_ids, dst_ids = [1, 2, 3], [4, 5, 6]
    with kvtransfer.create_sender("nixl", src, op="write", faults=f"{kind}=1.0,seed=1") as sender:
        peer.call("expect", kind, dst_ids, 3, 2.0)
        for layer in range(3):
            sender.send_layer(address, kind, layer, src_ids, dst_ids)
        with pytest.raises(KVTransferCorrupt if kind == "corrupt" else KVTransferTimeout):
            sender.finish(kind, timeout=4.0)
        with pytest.raises(PeerError) as err:
            peer.call("wait", kind, 4.0)
        assert err.value.type_name == ("KVTransferCorrupt" if kind == "corrupt" else "KVTransferTimeout")
        assert sender.metrics()["faults_injected"] >= 1 and sender.metrics()[f"faults_{kind}"] >= 1
    if kind == "corrupt":
        assert peer.call("metrics")["checksum_failures"] >= 1
    after = pools_after(peer)
    zeros = make_caches(FP32, seed=None)
    for layer in range(3):
        for pool in range(2):
            raw = after[layer][pool]
            assert torch.equal(raw[dst_ids], zeros[layer][pool][dst_ids])
    with kvtransfer.create_sender("nixl", src, op="write") as clean:
        _transfer(peer, clean, address, f"{kind}-clean", src_ids, [7, 8, 9])
    after = pools_after(peer)
    for layer in range(3):
        for pool in range(2):
            raw = after[layer][pool]
            assert torch.equal(raw[[7, 8, 9]], src[layer][pool][src_ids])


def test_nixl_faults_it_cannot_inject_are_refused():
    caches = make_caches(FP32, seed=1)
    for spec in ("duplicate=0.5", "reorder=0.1"):
        with pytest.raises(ValueError, match="drop and corrupt only"):
            kvtransfer.create_sender("nixl", caches, faults=spec)
