"""KV precision per transfer: one sender sends a transfer in full precision and the next in
FP8 (send_layer(precision=)) to the same receiver. The full one lands bit-exact; the FP8 one
lands as the FP8 round trip of the source (kernels.kv_codec.pack_blocks / unpack_blocks, the
FP8 cache's own quantization), in (BS + R) / (BS x itemsize) of the bytes. Over the fake
backend and UCX in one process, with plain and stacked (engine-like) pools, one layer per
message and coalesced, pull path on (an FP8 message is never pulled)."""

from __future__ import annotations

import pytest
import torch

from pdserve import kvtransfer
from pdserve.kernels import kv_codec, kv_quant
from pdserve.kvtransfer.layout import KVLayout

LAYERS, BLOCKS, BS, HK, D = 3, 16, 16, 2, 64


def pools(dtype, seed, stacked):
    gen = torch.Generator().manual_seed(seed)
    all_ = (torch.randn((LAYERS, 2, BLOCKS, BS, HK, D), generator=gen) * 3).to(dtype)
    if stacked:
        return all_, [(all_[i, 0], all_[i, 1]) for i in range(LAYERS)]
    caches = [(all_[i, 0].clone(), all_[i, 1].clone()) for i in range(LAYERS)]
    return all_, caches


def stack(caches):
    return torch.stack([torch.stack(pair) for pair in caches])


def round_trip(blocks):
    return kv_codec.unpack_blocks(kv_codec.pack_blocks(blocks), blocks.dtype)


CASES = [("fake", {}), ("ucx", {}), ("ucx", {"coalesce_bytes": 1 << 20})]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("backend, opts", CASES)
def test_full_then_fp8_then_full_on_one_pair(backend, opts, dtype, stacked):
    if backend == "ucx":
        pytest.importorskip("ucxx")
    src_all, src = pools(dtype, 1, stacked)
    _, dst = pools(dtype, 2, stacked)
    before = stack(dst).clone()
    layout = KVLayout.from_caches(src)
    full_bytes = LAYERS * layout.layer_message_bytes(3)
    fp8_bytes = LAYERS * 2 * 3 * (BS + 2) * HK * D  # 16 rows of e4m3, 1 of float32 scales, 1 of exponents
    plan = [("t0", "full", [1, 5, 9], [0, 2, 4]), ("t1", "fp8", [3, 7, 11], [6, 8, 10]),
            ("t2", "full", [12, 13, 14], [11, 12, 13])]
    with kvtransfer.create_receiver(backend, dst) as receiver, \
            kvtransfer.create_sender(backend, src, **opts) as sender:
        for tid, precision, src_ids, dst_ids in plan:
            receiver.expect(tid, dst_ids, LAYERS, 20.0)
            for layer in range(LAYERS):
                sender.send_layer(receiver.address(), tid, layer, src_ids, dst_ids, precision=precision)
            sent = sender.finish(tid, timeout=20)
            got = receiver.wait(tid, timeout=20)
            assert sent.num_bytes == got.num_bytes == (fp8_bytes if precision == "fp8" else full_bytes), tid
        with pytest.raises(ValueError, match="precision"):
            sender.send_layer(receiver.address(), "t3", 0, [0], [1], precision="fp4")
        assert receiver.metrics()["messages_fp8"] == (LAYERS if not opts else 1)
        assert receiver.metrics()["bytes_landed"] == 2 * full_bytes + fp8_bytes
    after = stack(dst)
    for tid, precision, src_ids, dst_ids in plan:
        want = src_all[:, :, src_ids]
        if precision == "fp8":
            want = round_trip(want)
            assert not torch.equal(want, src_all[:, :, src_ids])  # FP8 is lossy: the test can tell
            err = (after[:, :, dst_ids].float() - src_all[:, :, src_ids].float()).abs()
            assert float(err.max()) <= float(src_all.float().abs().max()) / 8  # e4m3: 3 mantissa bits
        assert torch.equal(after[:, :, dst_ids], want), tid
    untouched = [b for b in range(BLOCKS) if b not in {i for *_, d in plan for i in d}]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend, opts", CASES)
def test_a_full_head_block_interleaved_with_an_fp8_rest(backend, opts):
    """What the pusher sends for an FP8 transfer (pdserve.worker.kv_push): every layer, the head
    block at full precision then the rest in FP8, one transfer. Both streams keep their own
    coalescing (UCX: a message each when coalesced, not one per layer and precision), and the
    head lands bit-exact, the rest as the round trip."""
    if backend == "ucx":
        pytest.importorskip("ucxx")
    src_all, src = pools(torch.float32, 3, False)
    _, dst = pools(torch.float32, 4, False)
    head, rest, head_dst, rest_dst = [2], [4, 6, 8], [1], [3, 5, 7]
    with kvtransfer.create_receiver(backend, dst) as receiver, \
            kvtransfer.create_sender(backend, src, **opts) as sender:
        receiver.expect("h", head_dst + rest_dst, LAYERS, 20.0)
        for layer in range(LAYERS):
            sender.send_layer(receiver.address(), "h", layer, head, head_dst, precision="full")
            sender.send_layer(receiver.address(), "h", layer, rest, rest_dst, precision="fp8")
        sender.finish("h", timeout=20)
        receiver.wait("h", timeout=20)
        m = receiver.metrics()
        assert m["messages_fp8"] == (LAYERS if not opts else 1)
        assert m["messages_received"] == (2 * LAYERS if not opts else 2)
    after = stack(dst)
    assert torch.equal(after[:, :, head_dst], src_all[:, :, head])
    assert torch.equal(after[:, :, rest_dst], round_trip(src_all[:, :, rest]))


def test_fp8_bytes_land_as_is_in_an_fp8_pool():
    """From an FP8 pool, "fp8" ships the pool's bytes: they are FP8 already (and scale rows too)."""
    shape = kv_quant.fp8_pool_shape(8, BS, HK, D)
    src = [tuple(torch.randint(0, 120, shape, dtype=torch.uint8).view(kv_quant.FP8_DTYPE) for _ in range(2))
           for _ in range(2)]
    dst = [tuple(torch.zeros(shape, dtype=kv_quant.FP8_DTYPE) for _ in range(2)) for _ in range(2)]
    with kvtransfer.create_receiver("fake", dst) as receiver, kvtransfer.create_sender("fake", src) as sender:
        receiver.expect("f", [4, 5], 2, 10.0)
        for layer in range(2):
            sender.send_layer(receiver.address(), "f", layer, [0, 3], [4, 5], precision="fp8")
        assert sender.finish("f", timeout=10).num_bytes == 2 * 2 * 2 * (BS + 1) * HK * D
        receiver.wait("f", timeout=10)
        assert receiver.metrics()["messages_fp8"] == 0
    for layer in range(2):
        for pool in range(2):
            assert torch.equal(dst[layer][pool][[4, 5]].view(torch.uint8), src[layer][pool][[0, 3]].view(torch.uint8))


def test_pack_blocks_layout_and_channel_scales():
    """A wire block is the FP8 cache's block of x / 2^e (e: the channel exponents, its last row):
    the data and token scale rows are what write_fp8_ref stores for x / 2^e, and unpack gives
    that block's dequantized values times 2^e."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(4 * BS, HK, D, generator=gen)
    k[:, :, 1] *= 200  # an outlier channel
    k[:, :, 2] *= 1e-4  # a channel far below the token's largest value
    packed = kv_codec.pack_blocks(k.view(4, BS, HK, D))
    rows = kv_quant.fp8_block_rows(BS, D)
    assert packed.shape == (4, rows, HK, D) and rows == BS + kv_quant.scale_rows(BS, D) + 1
    exp = packed[:, -1].view(torch.int8).long()  # [4, HK, D]
    amax = k.view(4, BS, HK, D).abs().amax(1)
    assert bool((2.0 ** exp >= amax).all()) and bool((2.0 ** (exp - 1) < amax).all())
    y = k.view(4, BS, HK, D) / 2.0 ** exp[:, None]
    pool = torch.zeros(kv_quant.fp8_pool_shape(4, BS, HK, D), dtype=kv_quant.FP8_DTYPE)
    kv_quant.write_fp8_ref(y.reshape(-1, HK, D), y.reshape(-1, HK, D), pool, pool.clone(), torch.arange(4 * BS))
    assert torch.equal(packed[:, :-1], pool.view(torch.uint8))
    back = kv_codec.unpack_blocks(packed, torch.float32)
    want = kv_quant.gather_blocks(pool, torch.arange(4), torch.float32) * 2.0 ** exp[:, None]
    assert torch.equal(back, want)
    assert torch.equal(kv_codec.round_trip(k[:32], BS), back.reshape(-1, HK, D)[:32])
    assert kv_codec.round_trip(k[:37], BS).shape == (37, HK, D)  # the last block padded, its scales its own
    # the small channel keeps e4m3's relative precision; with token scales alone it fell to subnormals
    rel = ((back - k.view(4, BS, HK, D)) / k.view(4, BS, HK, D)).abs()[..., 2]
    q, s = kv_quant.quantize(k)
    rel_token_only = ((kv_quant.dequantize(q, s, torch.float32) - k) / k).abs()[..., 2]
    assert float(rel.max()) <= 2 ** -4 and float(rel_token_only.mean()) > 4 * float(rel.mean())
