"""The Triton kernels compiled for a real GPU, against the torch references on the same
device, in bf16 with bf16 tolerances. Skipped without CUDA."""

import math

import pytest
import torch

from pdserve.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from pdserve.kernels.cache import write_kv_cache_ref, write_kv_cache_triton
from pdserve.kernels.decode_attention import decode_attention_ref, decode_attention_triton
from pdserve.kernels.dispatch import triton_available
from pdserve.kernels.norm import rms_norm_ref, rms_norm_triton
from pdserve.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from pdserve.kernels.rope import apply_rope_ref, apply_rope_triton, rope_cos_sin_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
]

BF16 = torch.bfloat16
TOL = dict(rtol=2e-2, atol=2e-2)
DEV = "cuda"


@pytest.fixture(autouse=True)
def _compiled_not_interpreted():
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: these tests must compile for the GPU")


@pytest.mark.parametrize("hidden", [576, 4096])
def test_rms_norm(hidden):
    x = torch.randn(33, hidden, device=DEV, dtype=BF16)
    r = torch.randn(33, hidden, device=DEV, dtype=BF16)
    w = torch.rand(hidden, device=DEV, dtype=BF16) + 0.5
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **TOL)
    got, expected = rms_norm_triton(x, w, 1e-5, r), rms_norm_ref(x, w, 1e-5, r)
    torch.testing.assert_close(got[0], expected[0], **TOL)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)


def test_silu_and_mul():
    x = torch.randn(17, 2 * 1536, device=DEV, dtype=BF16)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **TOL)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope(head_dim):
    cache = rope_cos_sin_cache(head_dim, 4096, 500000.0, None, device=DEV)
    positions = torch.randint(0, 4096, (100,), device=DEV)
    q = torch.randn(100, 32, head_dim, device=DEV, dtype=BF16)
    k = torch.randn(100, 8, head_dim, device=DEV, dtype=BF16)
    got, expected = apply_rope_triton(q, k, positions, cache), apply_rope_ref(q, k, positions, cache)
    torch.testing.assert_close(got[0], expected[0], **TOL)
    torch.testing.assert_close(got[1], expected[1], **TOL)


@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache(block_size):
    k = torch.randn(50, 8, 128, device=DEV, dtype=BF16)
    v = torch.randn(50, 8, 128, device=DEV, dtype=BF16)
    slots = torch.randperm(10 * block_size, device=DEV)[:50]
    slots[::7] = -1
    caches = [torch.zeros(10, block_size, 8, 128, device=DEV, dtype=BF16) for _ in range(4)]
    write_kv_cache_triton(k, v, caches[0], caches[1], slots)
    write_kv_cache_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("seq_lens, q_lens, hq, hk, d, bs", [
    ([1, 15, 16, 17, 33], [1, 15, 16, 17, 33], 8, 8, 64, 16),
    ([1000, 300, 77], [1000, 1, 40], 32, 8, 128, 16),
    ([2048, 513], [700, 513], 24, 8, 128, 32),
    ([129], [129], 9, 3, 64, 32),
])
def test_prefill_attention(paged_kv, seq_lens, q_lens, hq, hk, d, bs):
    kv = paged_kv(seq_lens, hk, d, bs, BF16, device=DEV)
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=BF16)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEV)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 1 / math.sqrt(d))
    torch.testing.assert_close(prefill_attention_triton(*args), prefill_attention_ref(*args), **TOL)


@pytest.mark.parametrize("seq_lens, hq, hk, d, bs, num_splits", [
    ([1, 15, 16, 17, 33], 8, 8, 64, 16, None),
    ([4000, 1, 777, 64], 32, 8, 128, 16, None),
    ([3000, 2500], 32, 8, 128, 32, 7),
    ([129] * 40, 9, 3, 64, 32, None),
    ([5000], 64, 8, 128, 16, None),
    ([1100, 3, 700, 64] * 20, 32, 8, 128, 16, None),  # 80 x 8 programs: one split, the direct store
    ([900, 17], 32, 8, 128, 16, 1),
])
def test_decode_attention(paged_kv, seq_lens, hq, hk, d, bs, num_splits):
    kv = paged_kv(seq_lens, hk, d, bs, BF16, device=DEV)
    q = torch.randn(len(seq_lens), hq, d, device=DEV, dtype=BF16)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 1 / math.sqrt(d))
    got = decode_attention_triton(*args, num_splits=num_splits)
    torch.testing.assert_close(got, decode_attention_ref(*args), **TOL)


@pytest.mark.parametrize("block_size", [16, 32])
def test_rope_write_kv(block_size):
    from pdserve.kernels.rope_cache import rope_write_kv_ref, rope_write_kv_triton

    cache = rope_cos_sin_cache(128, 4096, 500000.0, None, device=DEV)
    qkv = torch.randn(60, (32 + 16) * 128, device=DEV, dtype=BF16)
    q = qkv[:, :32 * 128].view(60, 32, 128)
    k = qkv[:, 32 * 128:40 * 128].view(60, 8, 128)
    v = qkv[:, 40 * 128:].view(60, 8, 128)
    positions = torch.randint(0, 4096, (60,), device=DEV)
    slots = torch.randperm(10 * block_size, device=DEV)[:60]
    slots[::5] = -1
    caches = [torch.zeros(10, block_size, 8, 128, device=DEV, dtype=BF16) for _ in range(4)]
    got = rope_write_kv_triton(q, k, v, positions, cache, caches[0], caches[1], slots)
    want = rope_write_kv_ref(q, k, v, positions, cache, caches[2], caches[3], slots)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(caches[0], caches[2], **TOL)
    assert torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("bs", [16, 32])
def test_decode_attention_padding_rows_and_wide_tables(paged_kv, bs):
    """CUDA-graph style inputs: rows with seq len 0 give zeros, and a block table much wider
    than any sequence (the split count comes from its width) changes nothing."""
    kv = paged_kv([700, 1, 2100], 8, 128, bs, BF16, device=DEV)
    q = torch.randn(3, 32, 128, device=DEV, dtype=BF16)
    want = decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.088)
    wide = torch.full((5, 4096), 123456, dtype=torch.int32, device=DEV)  # stale entries: never read
    wide[:3, :kv.block_tables.shape[1]] = kv.block_tables
    lens = torch.zeros(5, dtype=torch.int32, device=DEV)
    lens[:3] = kv.seq_lens
    qp = torch.cat([q, torch.randn(2, 32, 128, device=DEV, dtype=BF16)])
    got = decode_attention_triton(qp, kv.k_cache, kv.v_cache, wide, lens, 0.088)
    torch.testing.assert_close(got[:3], want, **TOL)
    assert torch.equal(got[3:], torch.zeros_like(got[3:]))


@pytest.mark.parametrize("config", [(128, 64, 8, 3), (64, 64, 4, 2), (128, 128, 8, 2)])
def test_prefill_attention_configs(paged_kv, config):
    seq_lens, q_lens = [3000, 257, 1], [1500, 257, 1]
    kv = paged_kv(seq_lens, 8, 128, 16, BF16, device=DEV)
    q = torch.randn(sum(q_lens), 32, 128, device=DEV, dtype=BF16)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEV)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 1 / math.sqrt(128))
    torch.testing.assert_close(prefill_attention_triton(*args, config=config),
                               prefill_attention_ref(*args), **TOL)


# ---- FP8 KV pools (pdserve/kernels/kv_quant.py) ----------------------------------------------------

def _fp8_pools(num_blocks, bs, hk, d):
    from pdserve.kernels import kv_quant

    shape = kv_quant.fp8_pool_shape(num_blocks, bs, hk, d)
    return (torch.zeros(shape, dtype=kv_quant.FP8_DTYPE, device=DEV),
            torch.zeros(shape, dtype=kv_quant.FP8_DTYPE, device=DEV))


def _fp8_mismatch(ref, tri):
    """'' when the pools hold the same bytes, else how many scale and data bytes differ."""
    from pdserve.kernels import kv_quant

    out = []
    for name, a, b in zip("KV", ref, tri):
        (a_data, a_scales), (b_data, b_scales) = kv_quant.split_pool(a), kv_quant.split_pool(b)
        bad_scales = int((a_scales != b_scales).sum())
        bad_bytes = int((a_data.view(torch.uint8) != b_data.view(torch.uint8)).sum())
        if bad_scales or bad_bytes or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            out.append(f"{name}: {bad_scales} scales, {bad_bytes} data bytes differ")
    return "; ".join(out)


@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_fp8_exact(block_size):
    """On the GPU the kernel's scales and e4m3 bytes equal the torch path's (which divides
    exactly: `t / 448.0` on CUDA would multiply by a rounded reciprocal)."""
    t, hk, d = 77, 8, 128
    k = torch.randn(t, hk, d, device=DEV, dtype=BF16) * 4
    v = torch.randn(t, hk, d, device=DEV, dtype=BF16) * 0.05
    k[5, 2, :] = 0  # an all-zero head: scale 1
    slots = torch.randperm(8 * block_size, device=DEV)[:t]
    slots[3] = -1
    ref, tri = _fp8_pools(8, block_size, hk, d), _fp8_pools(8, block_size, hk, d)
    write_kv_cache_ref(k, v, *ref, slots)
    write_kv_cache_triton(k, v, *tri, slots)
    assert _fp8_mismatch(ref, tri) == ""


@pytest.mark.parametrize("hk, d, bs", [(8, 128, 16), (3, 64, 16), (3, 64, 32)])
def test_rope_write_kv_fp8_exact(hk, d, bs):
    """The fused RoPE + KV write the engine runs (SmolLM2: 3 kv heads of 64) into FP8 pools."""
    from pdserve.kernels.rope_cache import rope_write_kv_ref, rope_write_kv_triton

    t, hq = 61, 3 * hk
    cache = rope_cos_sin_cache(d, 4096, 100000.0, None, device=DEV)
    q = torch.randn(t, hq, d, device=DEV, dtype=BF16)
    k = torch.randn(t, hk, d, device=DEV, dtype=BF16) * 8
    v = torch.randn(t, hk, d, device=DEV, dtype=BF16) * 0.1
    positions = torch.randint(0, 4096, (t,), device=DEV)
    slots = torch.randperm(8 * bs, device=DEV)[:t]
    slots[::9] = -1
    tri = _fp8_pools(8, bs, hk, d)
    got = rope_write_kv_triton(q, k, v, positions, cache, *tri, slots)
    torch.testing.assert_close(got, rope_write_kv_ref(q, k, v, positions, cache, *_fp8_pools(8, bs, hk, d), slots),
                               **TOL)
    # The rotated k the kernel quantizes is its own bf16 rotation (within TOL of the torch
    # one, not always equal: test_rope_write_kv); take it from a bf16 write of the same call.
    rotated = [torch.zeros(8, bs, hk, d, device=DEV, dtype=BF16) for _ in range(2)]
    rope_write_kv_triton(q, k, v, positions, cache, *rotated, slots)
    kept = slots >= 0
    k_rot = rotated[0].view(-1, hk, d)[slots[kept]]
    ref = _fp8_pools(8, bs, hk, d)
    write_kv_cache_ref(k_rot, v[kept], *ref, slots[kept])
    assert _fp8_mismatch(ref, tri) == ""


def test_fp8_e4m3_bits_match_torch_cast_on_gpu():
    """The kernels' float32 -> e4m3 byte against torch's CUDA cast (clamped to +-448)."""
    from pdserve.kernels.cache import e4m3_bytes_ref, e4m3_bytes_triton
    from tests.kernels.test_kernel_kv_fp8 import e4m3_probe_values

    x = e4m3_probe_values().to(DEV)
    got, ref = e4m3_bytes_triton(x), e4m3_bytes_ref(x)
    bad = (got != ref).nonzero().squeeze(1)
    assert bad.numel() == 0, [(float(x[i]), int(got[i]), int(ref[i])) for i in bad[:8].tolist()]


@pytest.mark.parametrize("seq_lens, hq, hk, d, bs", [([1, 100, 1000, 4097], 32, 8, 128, 16), ([33, 700], 12, 2, 64, 32),
                                                     ([7, 130, 45], 9, 3, 64, 16)])
def test_attention_fp8_pools(paged_kv, seq_lens, hq, hk, d, bs):
    """Decode and prefill Triton kernels over FP8 pools against the torch path over the same pools."""
    kv = paged_kv(seq_lens, hk, d, bs, BF16, device=DEV, stale=0.0)
    k_pool, v_pool = _fp8_pools(kv.k_cache.shape[0], bs, hk, d)
    tables = kv.block_tables.clamp(min=0)
    for b, n in enumerate(seq_lens):
        slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(n)], device=DEV)
        write_kv_cache_ref(kv.keys[b].to(DEV), kv.values[b].to(DEV), k_pool, v_pool, slots)
    scale = d ** -0.5
    q = torch.randn(len(seq_lens), hq, d, device=DEV, dtype=BF16)
    ref = decode_attention_ref(q, k_pool, v_pool, tables, kv.seq_lens, scale)
    out = decode_attention_triton(q, k_pool, v_pool, tables, kv.seq_lens, scale)
    torch.testing.assert_close(out, ref, **TOL)
    qp = torch.randn(sum(seq_lens), hq, d, device=DEV, dtype=BF16)
    cu = torch.tensor([0] + seq_lens, dtype=torch.int32, device=DEV).cumsum(0, dtype=torch.int32)
    ref = prefill_attention_ref(qp, k_pool, v_pool, tables, cu, kv.seq_lens, scale)
    out = prefill_attention_triton(qp, k_pool, v_pool, tables, cu, kv.seq_lens, scale)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("lens, hq, hk, d", [([1, 100, 2048, 300], 32, 8, 128), ([4097, 5000], 32, 8, 128),
                                             ([33, 700, 64], 12, 2, 64)])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "loads"])
def test_dense_prefill_attention(lens, hq, hk, d, tma):
    """Fresh prompts over their own strided K/V: both tile configurations (short and long
    sequences) and both load paths, against the torch reference."""
    from pdserve.kernels.prefill_attention_dense import dense_prefill_attention_ref, dense_prefill_attention_triton

    t = sum(lens)
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEV, dtype=BF16)
    q = qkv[:, :hq * d].reshape(t, hq, d).contiguous()
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    cu = torch.tensor([0] + lens, dtype=torch.int32, device=DEV).cumsum(0, dtype=torch.int32)
    want = dense_prefill_attention_ref(q, k, v, cu, d ** -0.5)
    got = dense_prefill_attention_triton(q, k, v, cu, d ** -0.5, max_len=max(lens), tma=tma)
    torch.testing.assert_close(got, want, **TOL)
    got32 = dense_prefill_attention_triton(q.float(), k.float(), v.float(), cu, d ** -0.5, tma=tma)
    torch.testing.assert_close(got32, want.float(), **TOL)


def _moe_case(num_tokens, hidden, inter, num_experts, top_k, gen):
    x = torch.randn(num_tokens, hidden, device=DEV, generator=gen).to(BF16)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=DEV, generator=gen) / math.sqrt(hidden)).to(BF16)
    w2 = (torch.randn(num_experts, hidden, inter, device=DEV, generator=gen) / math.sqrt(inter)).to(BF16)
    return x, w13, w2


def _moe_routing(num_tokens, num_experts, top_k, gen, dropped=0):
    from pdserve.kernels.fused_moe import moe_route

    weights, ids = moe_route(torch.randn(num_tokens, num_experts, device=DEV, generator=gen), top_k, True)
    if dropped:
        flat = ids.view(-1)
        flat[torch.randperm(flat.numel(), device=DEV, generator=gen)[:dropped]] = -1
    return weights, ids


@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k", [
    (1, 1024, 768, 8, 2), (16, 2048, 768, 128, 8), (300, 1024, 512, 64, 8), (2048, 1024, 1536, 8, 2)])
def test_fused_moe(num_tokens, hidden, inter, num_experts, top_k):
    from pdserve.kernels.fused_moe import fused_moe_ref, fused_moe_triton

    gen = torch.Generator(device=DEV).manual_seed(num_tokens)
    x, w13, w2 = _moe_case(num_tokens, hidden, inter, num_experts, top_k, gen)
    weights, ids = _moe_routing(num_tokens, num_experts, top_k, gen, dropped=num_tokens // 3)
    got, want = fused_moe_triton(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids)
    assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_fused_moe_cuda_graph_replays_new_routing(num_tokens):
    """Captured once for a decode batch, replayed with fresh routing (ids of -1 included) and fresh
    hidden states: each replay equals the reference on that step's inputs."""
    from pdserve.kernels.fused_moe import fused_moe_ref, fused_moe_triton

    hidden, inter, num_experts, top_k = 1024, 768, 64, 8
    gen = torch.Generator(device=DEV).manual_seed(7)
    x, w13, w2 = _moe_case(num_tokens, hidden, inter, num_experts, top_k, gen)
    weights, ids = _moe_routing(num_tokens, num_experts, top_k, gen)
    fused_moe_triton(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, weights, ids)
    for step in range(4):
        new_weights, new_ids = _moe_routing(num_tokens, num_experts, top_k, gen, dropped=step * num_tokens)
        if step == 3:
            new_ids.fill_(5)  # every token on one expert: the longest run the padding allows
        x.copy_(torch.randn(x.shape, device=DEV, generator=gen).to(BF16))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), **TOL)
