"""FP8 KV pools (pdserve/kernels/kv_quant.py) through the fake backend: the quantized bytes and their
per-block scales land exactly, in 17/32 of the bytes a bf16 pool of the same blocks ships."""

import pytest
import torch

from pdserve import kvtransfer
from pdserve.kernels import kv_quant

LAYERS, BLOCKS, BS, HK, D = 2, 8, 16, 2, 64


def fp8_caches(seed):
    gen = torch.Generator().manual_seed(seed)
    shape = kv_quant.fp8_pool_shape(BLOCKS, BS, HK, D)
    caches = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            pool = torch.zeros(shape, dtype=kv_quant.FP8_DTYPE)
            slots = torch.arange(BLOCKS * BS)
            kv_quant.write_fp8_ref(torch.randn(BLOCKS * BS, HK, D, generator=gen),
                                   torch.randn(BLOCKS * BS, HK, D, generator=gen), pool, pool.clone(), slots)
            pair.append(pool)
        caches.append(tuple(pair))
    return caches


@pytest.mark.timeout(20)
def test_fp8_blocks_and_scales_land_exactly_in_half_the_bytes():
    src, dst = fp8_caches(1), fp8_caches(2)
    receiver = kvtransfer.create_receiver("fake", dst)
    sender = kvtransfer.create_sender("fake", src)
    try:
        src_ids, dst_ids = [6, 1, 3], [0, 5, 2]
        receiver.expect("fp8", dst_ids, LAYERS, deadline_s=10)
        for layer in range(LAYERS):
            sender.send_layer(receiver.address(), "fp8", layer, src_ids, dst_ids)
        sent = sender.finish("fp8", timeout=10)
        got = receiver.wait("fp8", timeout=10)
    finally:
        sender.close()
        receiver.close()
    bf16_bytes = LAYERS * 2 * len(src_ids) * BS * HK * D * 2
    assert got.num_bytes == sent.num_bytes == bf16_bytes * 17 // 32
    for layer in range(LAYERS):
        for pool in range(2):
            a, b = dst[layer][pool], src[layer][pool]
            assert torch.equal(a[dst_ids].view(torch.uint8), b[src_ids].view(torch.uint8))
            a_data, a_scales = kv_quant.split_pool(a)
            b_data, b_scales = kv_quant.split_pool(b)
            assert torch.equal(a_scales[dst_ids], b_scales[src_ids])
            assert not torch.equal(a_scales[4], b_scales[4])  # untouched blocks keep their own
