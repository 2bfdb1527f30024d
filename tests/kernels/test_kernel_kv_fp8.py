"""FP8 (e4m3) KV pools: layout, quantization error, the Triton kernels (interpreted on CPU)
against the torch path, and attention over FP8 pools against full precision."""

import pytest
import torch

from pdserve.kernels import kv_quant
from pdserve.kernels.cache import write_kv_cache_ref, write_kv_cache_triton
from pdserve.kernels.decode_attention import (decode_attention_planned, decode_attention_ref, decode_attention_triton,
                                      decode_gather_plan)
from pdserve.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from pdserve.kernels.rope import rope_cos_sin_cache
from pdserve.kernels.rope_cache import rope_write_kv_ref, rope_write_kv_triton

FP8 = kv_quant.FP8_DTYPE
NAN_BYTE = 0x7F  # e4m3fn NaN: unowned slots must never be read


@pytest.mark.parametrize("bs, d, rows", [(16, 128, 17), (16, 64, 17), (32, 64, 34), (8, 16, 10), (1, 16, 2)])
def test_pool_shape_and_block_size_round_trip(bs, d, rows):
    shape = kv_quant.fp8_pool_shape(5, bs, 3, d)
    assert shape == (5, rows, 3, d)
    pool = torch.zeros(shape, dtype=FP8)
    assert kv_quant.pool_block_size(pool) == bs
    data, scales = kv_quant.split_pool(pool)
    assert data.shape == (5, bs, 3, d) and scales.shape == (5, bs, 3) and scales.dtype == torch.float32
    scales[4, bs - 1, 2] = 1.5  # the last scale lies inside the block's trailing rows
    scales[4, 0, 1] = 2.5  # stored [Hkv, BS]: head 1, offset 0
    flat = pool[4].reshape(-1).view(torch.float32)
    assert float(flat[bs * 3 * d // 4 + bs * 3 - 1]) == 1.5 and float(flat[bs * 3 * d // 4 + bs]) == 2.5


def test_pool_shape_rejects_head_dim_not_multiple_of_4():
    with pytest.raises(ValueError, match="head_dim"):
        kv_quant.fp8_pool_shape(2, 16, 1, 6)


def test_quantize_error_within_half_an_e4m3_step():
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 64)[:, None, None]
    q, scale = kv_quant.quantize(x)
    back = kv_quant.dequantize(q, scale, torch.float32)
    # 3 mantissa bits: relative error <= 2^-4 for normal values; below the smallest normal
    # (2^-6 * scale) the subnormal step is 2^-9 * scale, so half of it absolute.
    bound = x.abs() * 2 ** -4 + scale[..., None] * 2 ** -10
    assert bool(((back - x).abs() <= bound * (1 + 1e-6)).all())
    assert torch.equal(x.abs().amax(-1) / 448.0, scale)
    zero_q, zero_scale = kv_quant.quantize(torch.zeros(2, 1, 16))
    assert torch.equal(zero_scale, torch.ones(2, 1)) and not zero_q.float().any()


def fp8_pools(num_blocks, bs, hk, d, stale=NAN_BYTE):
    shape = kv_quant.fp8_pool_shape(num_blocks, bs, hk, d)
    return (torch.full(shape, stale, dtype=torch.uint8).view(FP8),
            torch.full(shape, stale, dtype=torch.uint8).view(FP8))


def assert_fp8_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bytes and scales equal: the kernels round like torch on every device and under the
    interpreter (their e4m3 cast is integer arithmetic, kernels.cache._e4m3_bits)."""
    a_data, a_scales = kv_quant.split_pool(a)
    b_data, b_scales = kv_quant.split_pool(b)
    assert torch.equal(a_scales, b_scales)
    diff = a_data.view(torch.uint8) != b_data.view(torch.uint8)
    assert not bool(diff.any()), f"{int(diff.sum())} bytes differ"
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def e4m3_probe_values() -> torch.Tensor:
    """Every finite bf16, random float32 bit patterns, every e4m3 value and the midpoints
    between neighbours (ties) with their float32 neighbours, and the edges of the range."""
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 16,), generator=torch.Generator().manual_seed(5))
    random_f32 = bits.to(torch.int32).view(torch.float32)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[~torch.isnan(grid)].sort().values
    mids = (grid[:-1] + grid[1:]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    edges = torch.tensor([448.0, 449.0, 464.0, 470.0, 480.0, 1e30, float("inf"), 2 ** -6, 2 ** -9, 2 ** -10,
                          3 * 2 ** -11, 1e-45, -1e-40, 0.0, -0.0])
    x = torch.cat([every_bf16, random_f32, grid, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                   edges, -edges])
    return x[~torch.isnan(x)].contiguous()


def test_e4m3_bits_match_torch_cast(needs_triton):
    """The kernels' float32 -> e4m3 byte (clamp to +-448, nearest even) equals torch's cast."""
    from pdserve.kernels.cache import e4m3_bytes_ref, e4m3_bytes_triton

    x = e4m3_probe_values()
    got, ref = e4m3_bytes_triton(x), e4m3_bytes_ref(x)
    bad = (got != ref).nonzero().squeeze(1)
    assert bad.numel() == 0, [(float(x[i]), int(got[i]), int(ref[i])) for i in bad[:8]]
    nan = torch.tensor([float("nan"), -float("nan")])
    assert e4m3_bytes_triton(nan).tolist() == [0x7F, 0xFF] == e4m3_bytes_ref(nan).tolist()


def test_quantize_divides_exactly_and_never_overflows():
    """Scales are amax / 448 correctly rounded (not amax * (1/448), which torch computes for
    `t / 448.0` on CUDA), 1 where they underflow, and no byte is NaN."""
    amax = torch.tensor([1.0, 3.0, 7.3, 1e-3, 448.0, 2.0 ** -140, 1e-45, 0.0])
    scale = kv_quant.fp8_scales(amax)
    exact = (amax.double() / 448.0).float()
    assert torch.equal(scale[:6], exact[:6]) and scale[6:].tolist() == [1.0, 1.0]
    x = torch.tensor([[2.0 ** -140, -2.0 ** -141, 0.0, 2.0 ** -149]])
    q, s = kv_quant.quantize(x)
    assert not torch.isnan(q.float()).any() and float(q.float().abs().max()) == 448.0


@pytest.mark.parametrize("tokens, hk, d, bs", [(10, 2, 16, 8), (33, 3, 64, 16)])
def test_write_triton_matches_ref(needs_triton, tokens, hk, d, bs):
    gen = torch.Generator().manual_seed(tokens)
    k = torch.randn(tokens, hk, d, generator=gen) * 3
    v = torch.randn(tokens, hk, d, generator=gen) * 0.05
    num_blocks = -(-tokens // bs) + 2
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    slots[1] = -1  # padding: nothing written
    ref, tri = fp8_pools(num_blocks, bs, hk, d), fp8_pools(num_blocks, bs, hk, d)
    write_kv_cache_ref(k, v, *ref, slots)
    write_kv_cache_triton(k, v, *tri, slots)
    for a, b in zip(ref, tri):
        assert_fp8_equal(a, b)
    kept = slots >= 0
    back = kv_quant.gather_slots(ref[0], slots[kept], torch.float32)
    # half an e4m3 step: 2^-4 relative, or half the subnormal step (scale * 2^-10) absolute
    assert torch.allclose(back, k[kept], rtol=2 ** -4, atol=float(k.abs().amax()) / 448 * 2 ** -10)
    assert torch.isnan(kv_quant.gather_slots(ref[0], torch.tensor([int(slots[1])]), torch.float32)).all()


def test_rope_write_triton_matches_ref(needs_triton):
    # kernels._jit binds `tl` in kernels.rope only when a kernel of that file first runs, and
    # rope_write_kv uses its helpers (the load-order bug being fixed in pdserve/kernels/_jit.py)
    from pdserve.kernels.rope import apply_rope_triton

    apply_rope_triton(torch.zeros(1, 1, 32), torch.zeros(1, 1, 32), torch.zeros(1, dtype=torch.long),
                      rope_cos_sin_cache(32, 4, 10000.0))
    t, hq, hk, d, bs = 12, 4, 2, 32, 8
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hk, hk))
    positions = torch.randint(0, 60, (t,), generator=gen)
    cos_sin = rope_cos_sin_cache(d, 64, 10000.0, None)
    slots = torch.randperm(4 * bs, generator=gen)[:t]
    ref, tri = fp8_pools(4, bs, hk, d), fp8_pools(4, bs, hk, d)
    q_ref = rope_write_kv_ref(q, k, v, positions, cos_sin, *ref, slots)
    q_tri = rope_write_kv_triton(q, k, v, positions, cos_sin, *tri, slots)
    assert torch.allclose(q_ref, q_tri, atol=1e-6)
    for a, b in zip(ref, tri):
        assert_fp8_equal(a, b)


def fp8_copy(kv, d, stale=NAN_BYTE):
    """The sequences of a PagedKV written into FP8 pools at the same blocks."""
    num_blocks, bs, hk, _ = kv.k_cache.shape
    k_pool, v_pool = fp8_pools(num_blocks, bs, hk, d, stale)
    for b, n in enumerate(kv.seq_lens.tolist()):
        table = kv.block_tables[b]
        slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(n)])
        write_kv_cache_ref(kv.keys[b], kv.values[b], k_pool, v_pool, slots)
    return k_pool, v_pool


# (seq_lens, num_heads, num_kv_heads, head_dim, block_size)
DECODE_CASES = [([1, 15, 17], 4, 4, 64, 16), ([31, 33], 6, 2, 64, 32), ([100, 3], 8, 2, 128, 16)]


@pytest.mark.parametrize("seq_lens, hq, hk, d, bs", DECODE_CASES)
def test_decode_attention_fp8(paged_kv, needs_triton, seq_lens, hq, hk, d, bs):
    kv = paged_kv(seq_lens, hk, d, bs, torch.float32, seed=d)
    k_pool, v_pool = fp8_copy(kv, d)
    q = torch.randn(len(seq_lens), hq, d, generator=torch.Generator().manual_seed(1))
    scale = d ** -0.5
    full = decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    ref = decode_attention_ref(q, k_pool, v_pool, kv.block_tables, kv.seq_lens, scale)
    tri = decode_attention_triton(q, k_pool, v_pool, kv.block_tables, kv.seq_lens, scale, num_splits=2)
    # one split: the split kernel writes the output itself (no partials, no merge)
    one = decode_attention_triton(q, k_pool, v_pool, kv.block_tables, kv.seq_lens, scale, num_splits=1)
    assert torch.allclose(one, ref, atol=2e-5, rtol=1e-4)
    # the planned path gathers slot 0 for padding and masks it out: stale zeros, not NaN
    plan = decode_gather_plan(kv.block_tables.clamp(min=0), kv.seq_lens, bs)
    planned = decode_attention_planned(q, *fp8_copy(kv, d, stale=0), plan, scale)
    assert torch.allclose(tri, ref, atol=2e-5, rtol=1e-4)
    assert torch.allclose(planned, ref, atol=2e-5, rtol=1e-4)
    # K and V rows are N(0, 1): each dequantized element is within 2^-4 relative; outputs of
    # magnitude <= ~1 then move by a few hundredths (0.085 at most in these cases).
    assert float((ref - full).abs().max()) < 0.15
    assert float((ref - full).abs().max()) > 0  # really quantized


PREFILL_CASES = [([15, 17], [15, 5], 4, 2, 64, 16), ([40], [40], 8, 1, 128, 16), ([9, 30], [1, 30], 6, 2, 32, 8)]


@pytest.mark.parametrize("seq_lens, q_lens, hq, hk, d, bs", PREFILL_CASES)
def test_prefill_attention_fp8(paged_kv, needs_triton, seq_lens, q_lens, hq, hk, d, bs):
    kv = paged_kv(seq_lens, hk, d, bs, torch.float32, seed=d + 1)
    k_pool, v_pool = fp8_copy(kv, d)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    tables = kv.block_tables.clamp(min=0)
    scale = d ** -0.5
    full = prefill_attention_ref(q, kv.k_cache, kv.v_cache, tables, cu, kv.seq_lens, scale)
    ref = prefill_attention_ref(q, k_pool, v_pool, tables, cu, kv.seq_lens, scale)
    tri = prefill_attention_triton(q, k_pool, v_pool, tables, cu, kv.seq_lens, scale)
    assert torch.allclose(tri, ref, atol=2e-5, rtol=1e-4)
    assert 0 < float((ref - full).abs().max()) < 0.12


def test_kernels_reject_mixed_pool_dtypes():
    k_pool, _ = fp8_pools(2, 16, 1, 16)
    v_pool = torch.zeros(2, 16, 1, 16)
    with pytest.raises(ValueError, match="v_cache dtype"):
        decode_attention_triton(torch.zeros(1, 1, 16), k_pool, v_pool, torch.zeros(1, 1, dtype=torch.int32),
                                torch.ones(1, dtype=torch.int32), 1.0)


def test_kv_cache_dtype_names():
    assert kv_quant.kv_cache_torch_dtype("auto", torch.float32) == torch.float32
    assert kv_quant.kv_cache_torch_dtype("bf16", torch.bfloat16) == torch.bfloat16
    assert kv_quant.kv_cache_torch_dtype("fp8", torch.float32) == FP8
    with pytest.raises(ValueError, match="bf16 needs a bfloat16 model"):
        kv_quant.kv_cache_torch_dtype("bf16", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_quant.kv_cache_torch_dtype("fp4", torch.float32)
