"""UCX backend between two processes over loopback (TCP / shared memory).

ucxx must initialise here: a failure is a test failure, never a skip.
"""

import threading
import time

import pytest
import torch

from pdserve import kvtransfer
from pdserve.kvtransfer import KVTransferError
from kvx_peer import CacheSpec, Peer, PeerError, block_bytes, make_caches

pytestmark = pytest.mark.timeout(60)

FP32 = CacheSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
BF16 = CacheSpec(num_layers=3, num_blocks=12, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")


@pytest.fixture(scope="module")
def peer():
    peer = Peer()
    yield peer
    assert peer.stop() == 0, "peer process did not exit cleanly"


def loop_threads():
    return [t for t in threading.enumerate() if t.name.startswith("kvtransfer-") and t.is_alive()]


def test_ucx_imports_wheel_library():
    from pdserve.kvtransfer.ucx_runtime import UcxRuntime, ucx_library_path

    runtime = UcxRuntime.acquire()  # raises KVTransferError if ucxx cannot initialise
    try:
        assert runtime.ucxx.get_ucx_version() >= (1, 19, 0)
        assert "/libucx/lib/" in ucx_library_path()
    finally:
        UcxRuntime.release()


def test_ucx_fp32_lands_exact_blocks(peer):
    src = make_caches(FP32, seed=11)
    address = peer.call("open_receiver", FP32)
    assert address.startswith("ucx://127.0.0.1:")
    src_ids, dst_ids = [9, 2, 14, 5, 0], [3, 11, 0, 7, 15]
    with kvtransfer.create_sender("ucx", src) as sender:
        for n in range(2):  # a second transfer reuses the connection
            transfer_id = f"fp32-{n}"
            peer.call("expect", transfer_id, dst_ids, 3, 20.0)
            for layer in range(3):
                sender.send_layer(address, transfer_id, layer, src_ids, dst_ids)
            sent = sender.finish(transfer_id, timeout=20)
            landed = peer.call("wait", transfer_id, 20.0)
            assert sent.num_bytes == landed.num_bytes == 3 * 2 * 5 * FP32.block_size * 2 * 8 * 4
        assert sender.metrics()["transfers_completed"] == 2
    after = peer.call("read_all")
    zeros = make_caches(FP32, seed=None)
    for layer in range(3):
        for pool in range(2):
            raw = torch.frombuffer(bytearray(after[layer][pool]), dtype=torch.float32).view(16, 4, 2, 8)
            assert torch.equal(raw[dst_ids], src[layer][pool][src_ids])
            untouched = [b for b in range(16) if b not in dst_ids]
            assert torch.equal(raw[untouched], zeros[layer][pool][untouched])
    metrics = peer.call("metrics")
    assert metrics["transfers_completed"] == 2 and metrics["messages_dropped"] == 0


def test_ucx_bf16_child_sends_to_parent(peer):
    dst = make_caches(BF16, seed=None)
    src_ids, dst_ids = [1, 10, 4], [8, 2, 5]
    with kvtransfer.create_receiver("ucx", dst) as receiver:
        receiver.expect("bf16", dst_ids, 3, deadline_s=20)
        peer.call("open_sender", BF16, 22)
        for layer in range(3):  # two chunks per layer, as chunked prefill sends them
            peer.call("send_layer", receiver.address(), "bf16", layer, src_ids[:2], dst_ids[:2])
            peer.call("send_layer", receiver.address(), "bf16", layer, src_ids[2:], dst_ids[2:])
        result = receiver.wait("bf16", timeout=20)
        assert peer.call("finish", "bf16", 20.0).num_bytes == result.num_bytes
    src = make_caches(BF16, seed=22)
    for layer in range(3):
        assert block_bytes(dst, layer, dst_ids) == block_bytes(src, layer, src_ids)
        others = [b for b in range(12) if b not in dst_ids]
        assert not dst[layer][0][others].any() and not dst[layer][1][others].any()


def wait_for(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.01)


def test_ucx_deadline_drops_late_data(peer):
    src = make_caches(FP32, seed=33)
    zeros = make_caches(FP32, seed=None)
    address = peer.call("open_receiver", FP32)
    with kvtransfer.create_sender("ucx", src) as sender:
        # A: layer 0 lands in time, the deadline passes, the rest is never written
        peer.call("expect", "late", [4, 5], 3, 1.0)
        sender.send_layer(address, "late", 0, [1, 2], [4, 5])
        wait_for(lambda: peer.call("metrics")["messages_received"] >= 1)
        with pytest.raises(PeerError) as missed:
            peer.call("wait", "late", 10.0)
        assert missed.value.type_name == "KVTransferTimeout"
        for layer in (1, 2):
            sender.send_layer(address, "late", layer, [1, 2], [4, 5])
        with pytest.raises(KVTransferError, match="deadline_passed"):
            sender.finish("late", timeout=10)
        assert peer.call("read", 0, [4, 5]) == block_bytes(src, 0, [1, 2])

        # B: nothing arrives before the deadline; data that arrives later is dropped
        peer.call("expect", "later", [8, 9], 3, 0.3)
        with pytest.raises(PeerError, match="KVTransferTimeout"):
            peer.call("wait", "later", 10.0)
        for layer in range(3):
            sender.send_layer(address, "later", layer, [1, 2], [8, 9])
        with pytest.raises(KVTransferError, match="deadline_passed"):
            sender.finish("later", timeout=10)
        wait_for(lambda: peer.call("metrics")["messages_dropped"] >= 1)
        metrics = peer.call("metrics")
        assert metrics["transfers_expired"] == 2 and metrics["transfers_pending"] == 0
        for layer in range(3):
            for ids in ([8, 9], [4, 5]) if layer else ([8, 9],):
                assert peer.call("read", layer, ids) == block_bytes(zeros, layer, ids)

        # the connection stays in sync: the next transfer on it lands
        peer.call("expect", "next", [6], 3, 20.0)
        for layer in range(3):
            sender.send_layer(address, "next", layer, [3], [6])
        sender.finish("next", timeout=20)
        peer.call("wait", "next", 20.0)
        assert peer.call("read", 2, [6]) == block_bytes(src, 2, [3])


def test_ucx_layout_mismatch_rejected_at_handshake(peer):
    address = peer.call("open_receiver", FP32)
    other = CacheSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=16)
    with kvtransfer.create_sender("ucx", make_caches(other, seed=1)) as sender:
        peer.call("expect", "mismatch", [0], 3, 5.0)
        sender.send_layer(address, "mismatch", 0, [0], [0])
        with pytest.raises(KVTransferError, match="layout mismatch"):
            sender.finish("mismatch", timeout=10)
    assert peer.call("metrics")["handshake_errors"] == 1
    assert peer.call("read", 0, [0]) == block_bytes(make_caches(FP32, None), 0, [0])


def test_ucx_model_mismatch_rejected_at_handshake(peer):
    address = peer.call("open_receiver", FP32, model="org/decode-model")
    try:
        with kvtransfer.create_sender("ucx", make_caches(FP32, seed=1), model="org/prefill-model") as sender:
            peer.call("expect", "model", [0], 3, 5.0)
            sender.send_layer(address, "model", 0, [0], [0])
            with pytest.raises(KVTransferError, match="model mismatch: peer serves 'org/decode-model'"):
                sender.finish("model", timeout=10)
        assert peer.call("metrics")["handshake_errors"] == 1
        assert peer.call("read", 0, [0]) == block_bytes(make_caches(FP32, None), 0, [0])
    finally:
        peer.call("open_receiver", FP32)


def test_ucx_wire_version_mismatch_rejected_at_handshake(peer):
    address = peer.call("open_receiver", FP32, 99)
    try:
        with kvtransfer.create_sender("ucx", make_caches(FP32, seed=1)) as sender:
            sender.send_layer(address, "v", 0, [0], [0])
            with pytest.raises(KVTransferError, match="version mismatch"):
                sender.finish("v", timeout=10)
        assert peer.call("metrics")["handshake_errors"] == 1
    finally:
        peer.call("open_receiver", FP32)  # back to this process's wire version


def test_ucx_close_leaves_no_thread_or_process():
    peer = Peer()
    try:
        native_after_close = []
        for round in range(3):  # later open/close cycles must not add threads
            address = peer.call("open_receiver", FP32)
            sender = kvtransfer.create_sender("ucx", make_caches(FP32, seed=5))
            peer.call("expect", "bye", [1], 3, 20.0)
            for layer in range(3):
                sender.send_layer(address, "bye", layer, [2], [1])
            sender.finish("bye", timeout=20)
            peer.call("wait", "bye", 20.0)
            peer.call("expect", "pending", [2], 3, 20.0)  # still pending when the receiver closes
            sender.close()
            sender.close()
            assert loop_threads() == []
            peer.call("close")
            assert peer.call("threads") == ["MainThread"]
            native_after_close.append(peer.call("native_threads"))
        # UCX keeps one process-wide async thread once started, and the first landing
        # threads leave one pool thread behind (seen once, at the second cycle); nothing accumulates
        assert native_after_close[2] == native_after_close[1]
    finally:
        assert peer.stop(timeout=20) == 0
    assert not peer.process.is_alive()


@pytest.mark.gpu
def test_ucx_cuda_to_cuda_between_processes(peer):
    spec = CacheSpec(num_layers=2, num_blocks=32, block_size=16, num_kv_heads=8, head_dim=128,
                     dtype="bfloat16", device="cuda")
    src = make_caches(spec, seed=44)
    address = peer.call("open_receiver", spec)
    src_ids, dst_ids = [3, 30, 7, 12], [0, 5, 31, 9]
    with kvtransfer.create_sender("ucx", src) as sender:
        peer.call("expect", "cuda", dst_ids, 2, 30.0)
        for layer in range(2):
            sender.send_layer(address, "cuda", layer, src_ids, dst_ids)
        sender.finish("cuda", timeout=30)
        peer.call("wait", "cuda", 30.0)
    for layer in range(2):
        assert peer.call("read", layer, dst_ids) == block_bytes(src, layer, src_ids)
    peer.call("open_receiver", FP32)


@pytest.mark.gpu
def test_ucx_cuda_pull_between_processes(peer):
    """Stacked CUDA pools in two processes (on two GPUs when there are two): after the first
    transfer opens the link, the receiver maps the sender's pools over CUDA IPC and pulls the
    blocks; every transfer lands exactly."""
    from dataclasses import replace

    spec = CacheSpec(num_layers=4, num_blocks=40, block_size=16, num_kv_heads=8, head_dim=128,
                     dtype="bfloat16", device="cuda:0", stacked=True)
    src = make_caches(spec, seed=45)
    receiver_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    address = peer.call("open_receiver", replace(spec, num_blocks=24, device=receiver_device))
    src_ids, dst_ids = [39, 2, 17, 8, 30], [0, 23, 5, 11, 6]
    with kvtransfer.create_sender("ucx", src) as sender:
        for n in range(3):
            peer.call("expect", f"pull{n}", dst_ids, 4, 30.0)
            for layer in range(4):
                sender.send_layer(address, f"pull{n}", layer, src_ids, dst_ids)
            sender.finish(f"pull{n}", timeout=30)
            peer.call("wait", f"pull{n}", 30.0)
            for layer in range(4):
                assert peer.call("read", layer, dst_ids) == block_bytes(src, layer, src_ids)
    metrics = peer.call("metrics")
    assert metrics["pull_links"] == 1 and metrics["messages_pulled"] >= 2
    peer.call("open_receiver", FP32)


def test_ucx_coalesces_consecutive_layers(peer):
    """With coalesce_bytes set, a chunk's layers travel in one message; interleaved transfers
    and a chunk that ends before the last layer (flushed by finish) land exactly too."""
    src = make_caches(FP32, seed=31)
    address = peer.call("open_receiver", FP32)
    a_src, a_dst, b_src, b_dst = [1, 6], [4, 9], [3, 12, 7], [0, 2, 13]
    with kvtransfer.create_sender("ucx", src, coalesce_bytes=1 << 20) as sender:
        peer.call("expect", "a", a_dst, 3, 20.0)
        peer.call("expect", "b", b_dst, 2, 20.0)  # b's chunk stops after layer 1
        for layer in range(3):
            sender.send_layer(address, "a", layer, a_src, a_dst)
            if layer < 2:
                sender.send_layer(address, "b", layer, b_src, b_dst)
        assert sender.finish("a", timeout=20).num_bytes == 3 * 2 * 2 * FP32.block_size * 2 * 8 * 4
        assert sender.finish("b", timeout=20).num_bytes == 2 * 2 * 3 * FP32.block_size * 2 * 8 * 4
        assert sender.metrics()["messages_sent"] == 2  # one per transfer, not one per layer
        peer.call("wait", "a", 20.0)
        peer.call("wait", "b", 20.0)
    after = peer.call("read_all")
    for layer in range(3):
        for pool in range(2):
            raw = torch.frombuffer(bytearray(after[layer][pool]), dtype=torch.float32).view(16, 4, 2, 8)
            assert torch.equal(raw[a_dst], src[layer][pool][a_src])
            if layer < 2:
                assert torch.equal(raw[b_dst], src[layer][pool][b_src])


def test_ucx_coalesce_bytes_is_checked():
    with pytest.raises(ValueError, match="coalesce_bytes must be an int >= 0"):
        kvtransfer.create_sender("ucx", make_caches(FP32, seed=1), coalesce_bytes=-1)


def test_ucx_stacked_pools_one_op_per_message():
    """Pools that are views of one [layers, 2, ...] allocation (as the engine makes them) are
    gathered and scattered a message at a time; the blocks land exactly, in-process over UCX."""
    from pdserve.kvtransfer.staging import stacked_pools

    gen = torch.Generator().manual_seed(7)
    src_pools = torch.randn((3, 2, 16, 4, 2, 8), generator=gen)
    dst_pools = torch.zeros_like(src_pools)
    src = [(src_pools[i, 0], src_pools[i, 1]) for i in range(3)]
    dst = [(dst_pools[i, 0], dst_pools[i, 1]) for i in range(3)]
    assert stacked_pools(src) is not None
    src_ids, dst_ids = [9, 2, 14], [3, 11, 0]
    with kvtransfer.create_receiver("ucx", dst) as receiver, \
            kvtransfer.create_sender("ucx", src, coalesce_bytes=1 << 20) as sender:
        for n in range(2):  # the second reuses the connection and the staging slots
            receiver.expect(f"s{n}", dst_ids, 3, 20.0)
            for layer in range(3):
                sender.send_layer(receiver.address(), f"s{n}", layer, src_ids, dst_ids)
            sender.finish(f"s{n}", timeout=20)
            receiver.wait(f"s{n}", timeout=20)
            assert torch.equal(dst_pools[:, :, dst_ids], src_pools[:, :, src_ids])
            dst_pools.zero_()
        assert sender.metrics()["messages_sent"] == 2
        # the first transfer opened the link (staged); the second was pulled from the sender's pools
        assert receiver.metrics()["pull_links"] == 1
        assert receiver.metrics()["messages_pulled"] == 1


def test_ucx_pull_off_keeps_the_staged_path():
    gen = torch.Generator().manual_seed(8)
    src_pools = torch.randn((2, 2, 8, 4, 2, 8), generator=gen)
    dst_pools = torch.zeros_like(src_pools)
    src = [(src_pools[i, 0], src_pools[i, 1]) for i in range(2)]
    dst = [(dst_pools[i, 0], dst_pools[i, 1]) for i in range(2)]
    with kvtransfer.create_receiver("ucx", dst) as receiver, \
            kvtransfer.create_sender("ucx", src, coalesce_bytes=1 << 20, pull=False) as sender:
        for n in range(2):
            receiver.expect(f"p{n}", [5, 1], 2, 20.0)
            for layer in range(2):
                sender.send_layer(receiver.address(), f"p{n}", layer, [0, 7], [5, 1])
            assert sender.finish(f"p{n}", timeout=20).num_bytes == 2 * 2 * 2 * 4 * 2 * 8 * 4
            receiver.wait(f"p{n}", timeout=20)
            assert torch.equal(dst_pools[:, :, [5, 1]], src_pools[:, :, [0, 7]])
        assert receiver.metrics()["pull_links"] == 0 and receiver.metrics()["messages_pulled"] == 0


def test_ucx_pulled_chunks_and_interleaved_transfers_land_exactly():
    """On a pulling link, two interleaved transfers and a chunked prompt (blocks sent in two
    chunks) land exactly; bytes are counted as sent. A pulled message is not bound by the
    staging size (coalesce_bytes): each chunk of each transfer is one message."""
    gen = torch.Generator().manual_seed(9)
    src_pools = torch.randn((4, 2, 24, 4, 2, 8), generator=gen)
    dst_pools = torch.zeros((4, 2, 20, 4, 2, 8))  # a different pool size on each side
    src = [(src_pools[i, 0], src_pools[i, 1]) for i in range(4)]
    dst = [(dst_pools[i, 0], dst_pools[i, 1]) for i in range(4)]
    block = 2 * 4 * 2 * 8 * 4
    with kvtransfer.create_receiver("ucx", dst) as receiver, \
            kvtransfer.create_sender("ucx", src, coalesce_bytes=block * 3) as sender:
        receiver.expect("warm", [0], 4, 20.0)
        for layer in range(4):
            sender.send_layer(receiver.address(), "warm", layer, [0], [0])
        sender.finish("warm", timeout=20)
        receiver.wait("warm", timeout=20)
        receiver.expect("a", [3, 4, 19], 4, 20.0)
        receiver.expect("b", [10, 11], 4, 20.0)
        for layer in range(4):
            sender.send_layer(receiver.address(), "a", layer, [23, 2], [3, 4])  # first chunk
            sender.send_layer(receiver.address(), "b", layer, [5, 6], [10, 11])
        for layer in range(4):
            sender.send_layer(receiver.address(), "a", layer, [17], [19])  # second chunk
        assert sender.finish("a", timeout=20).num_bytes == 4 * 3 * block
        assert sender.finish("b", timeout=20).num_bytes == 4 * 2 * block
        receiver.wait("a", timeout=20)
        receiver.wait("b", timeout=20)
        assert torch.equal(dst_pools[:, :, [3, 4, 19]], src_pools[:, :, [23, 2, 17]])
        assert torch.equal(dst_pools[:, :, [10, 11]], src_pools[:, :, [5, 6]])
        assert receiver.metrics()["messages_pulled"] == 3


def test_ucx_stray_connection_changes_nothing():
    """A KV connection the request plane did not announce (a valid protocol speaker that does not
    know the transfer's id, or one speaking garbage) is dropped without touching the pools; the
    announced transfer to the same blocks still lands."""
    import asyncio

    import numpy as np

    from pdserve.kvtransfer.ucx_runtime import UcxRuntime, parse_address

    src = make_caches(FP32, seed=41)
    dst = make_caches(FP32, seed=None)
    dst_ids = [3, 8]
    before = [(k.clone(), v.clone()) for k, v in dst]
    with kvtransfer.create_receiver("ucx", dst) as receiver:
        announced = "req-1/" + "5f" * 16  # as Reserve makes it: 128 random bits
        receiver.expect(announced, dst_ids, 3, 20.0)
        with kvtransfer.create_sender("ucx", src) as stray:
            for layer in range(3):
                stray.send_layer(receiver.address(), "req-1/guess", layer, [1, 2], dst_ids)
            with pytest.raises(KVTransferError, match="unknown_transfer"):
                stray.finish("req-1/guess", timeout=20)
        rt = UcxRuntime.acquire()
        try:  # garbage on a fresh connection: a protocol error, the connection is closed
            host, port = parse_address(receiver.address())

            async def garbage():
                ep = await rt.ucxx.create_endpoint(host, port)
                await ep.send(np.frombuffer(b"\x00" * 96, dtype=np.uint8))
                await asyncio.sleep(0.2)
                ep.abort()

            rt.call(garbage())
        finally:
            UcxRuntime.release()
        assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(dst, before))
        metrics = receiver.metrics()
        assert metrics["messages_dropped"] == 3 and metrics["bytes_landed"] == 0
        assert metrics["protocol_errors"] >= 1
        with kvtransfer.create_sender("ucx", src) as sender:
            for layer in range(3):
                sender.send_layer(receiver.address(), announced, layer, [1, 2], dst_ids)
            sender.finish(announced, timeout=20)
        receiver.wait(announced, timeout=20)
    for layer in range(3):
        for pool in range(2):
            assert torch.equal(dst[layer][pool][dst_ids], src[layer][pool][[1, 2]])
