"""Prefill and decode attention: torch references against a naive dense attention, and the
Triton kernels (interpreted on CPU) against the torch references."""

import math

import pytest
import torch

from pdserve.kernels.decode_attention import (decode_attention_planned, decode_attention_ref, decode_attention_triton,
                                      decode_gather_plan)
from pdserve.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton

F32, F16 = torch.float32, torch.float16


def make_prefill(paged_kv, seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    kv = paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=len(seq_lens) + head_dim)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return kv, q, cu


def naive_prefill(naive_attention, kv, q, cu, q_lens, scale):
    outs = [naive_attention(q[cu[b]:cu[b + 1]], kv.keys[b], kv.values[b], scale)
            for b in range(len(q_lens))]
    return torch.cat(outs)


def naive_decode(naive_attention, kv, q, scale):
    return torch.cat([naive_attention(q[b:b + 1], kv.keys[b], kv.values[b], scale)
                      for b in range(q.shape[0])])


# (seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
PREFILL_CASES = [
    pytest.param([1], [1], 4, 4, 64, 16, F32, id="single-token"),
    pytest.param([15, 16, 17], [15, 16, 17], 4, 4, 64, 16, F32, id="bs16-boundaries"),
    pytest.param([31, 32, 33], [31, 32, 33], 6, 2, 64, 32, F32, id="bs32-boundaries-gqa3"),
    pytest.param([40, 9], [5, 9], 8, 2, 128, 16, F32, id="cached-prefix-gqa4-d128"),
    pytest.param([37, 20, 3], [1, 20, 2], 8, 1, 64, 32, F32, id="varlen-qlen1-gqa8"),
    pytest.param([50], [17], 4, 1, 32, 16, F32, id="prefix-d32"),
    pytest.param([23, 18], [23, 7], 4, 2, 64, 16, F16, id="fp16-varlen"),
    pytest.param([33], [33], 3, 1, 128, 32, F16, id="fp16-gqa3-d128"),
]

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits)
DECODE_CASES = [
    pytest.param([1, 15, 16, 17], 4, 4, 64, 16, F32, None, id="bs16-boundaries"),
    pytest.param([31, 32, 33], 6, 2, 64, 32, F32, 3, id="bs32-boundaries-gqa3"),
    pytest.param([100, 1, 47], 8, 2, 128, 16, F32, 4, id="gqa4-d128-splits4"),
    pytest.param([65, 9], 8, 1, 64, 32, F32, 1, id="gqa8-one-split"),
    pytest.param([9, 3], 4, 2, 64, 16, F32, 8, id="more-splits-than-tokens"),
    pytest.param([70, 5], 4, 1, 32, 16, F16, 2, id="fp16-d32"),
    pytest.param([40, 33], 12, 4, 128, 32, F16, None, id="fp16-gqa3-d128"),
    pytest.param([33, 17, 1], 8, 2, 64, 16, F16, 1, id="fp16-one-split-direct"),
]


@pytest.mark.parametrize("seq_lens, q_lens, hq, hk, d, bs, dtype", PREFILL_CASES[:6])
def test_prefill_ref_matches_naive(paged_kv, naive_attention, seq_lens, q_lens, hq, hk, d, bs, dtype):
    kv, q, cu = make_prefill(paged_kv, seq_lens, q_lens, hq, hk, d, bs, dtype)
    scale = 1 / math.sqrt(d)
    got = prefill_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, scale)
    expected = naive_prefill(naive_attention, kv, q, cu, q_lens, scale)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_lens, hq, hk, d, bs, dtype, num_splits", DECODE_CASES[:5])
def test_decode_ref_matches_naive(paged_kv, naive_attention, seq_lens, hq, hk, d, bs, dtype, num_splits):
    kv = paged_kv(seq_lens, hk, d, bs, dtype, seed=3)
    q = torch.randn(len(seq_lens), hq, d).to(dtype)
    scale = 1 / math.sqrt(d)
    got = decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    torch.testing.assert_close(got.double(), naive_decode(naive_attention, kv, q, scale),
                               rtol=1e-5, atol=1e-5)


def test_decode_ref_bf16_close_to_naive(paged_kv, naive_attention):
    kv = paged_kv([20, 3], 2, 64, 16, torch.bfloat16)
    q = torch.randn(2, 4, 64).bfloat16()
    got = decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), naive_decode(naive_attention, kv, q, 0.125),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seq_lens, hq, hk, d, bs, dtype, num_splits", DECODE_CASES[:5] + [
    pytest.param([37], 6, 2, 64, 16, F32, None, id="single-unmasked"),
    pytest.param([20, 20], 4, 4, 64, 16, F32, None, id="equal-unmasked")])
@pytest.mark.parametrize("gather_free", [False, True], ids=["sdpa", "gather-free"])
def test_decode_planned_matches_ref(paged_kv, seq_lens, hq, hk, d, bs, dtype, num_splits, gather_free):
    """The CPU engine's per-step plan equals the reference, with and without a mask, both as
    SDPA over gathered K/V and in the gather-free form torch.compile runs."""
    kv = paged_kv(seq_lens, hk, d, bs, dtype, seed=4, stale=0.0)
    q = torch.randn(len(seq_lens), hq, d).to(dtype)
    scale = 1 / math.sqrt(d)
    slots, mask, length = plan = decode_gather_plan(kv.block_tables, kv.seq_lens, bs)
    assert length == max(seq_lens) and slots.shape == (len(seq_lens) * length,)
    assert (mask is None) == (len(set(seq_lens)) == 1)
    got = decode_attention_planned(q, kv.k_cache, kv.v_cache, plan, scale, gather_free=gather_free)
    expected = decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_lens, q_lens, hq, hk, d, bs, dtype", PREFILL_CASES)
def test_prefill_triton_matches_ref(paged_kv, needs_triton, seq_lens, q_lens, hq, hk, d, bs, dtype):
    kv, q, cu = make_prefill(paged_kv, seq_lens, q_lens, hq, hk, d, bs, dtype)
    scale = 1 / math.sqrt(d)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, scale)
    got, expected = prefill_attention_triton(*args), prefill_attention_ref(*args)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == F32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("seq_lens, hq, hk, d, bs, dtype, num_splits", DECODE_CASES)
def test_decode_triton_matches_ref(paged_kv, needs_triton, seq_lens, hq, hk, d, bs, dtype, num_splits):
    kv = paged_kv(seq_lens, hk, d, bs, dtype, seed=5)
    q = torch.randn(len(seq_lens), hq, d).to(dtype)
    scale = 1 / math.sqrt(d)
    got = decode_attention_triton(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale,
                                  num_splits=num_splits)
    expected = decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == F32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got, expected, **tol)


def test_triton_rejects_non_power_of_two_head_dim(paged_kv):
    kv = paged_kv([4], 1, 48, 16, F32, stale=0.0)
    q = torch.randn(4, 2, 48)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="power-of-two"):
        prefill_attention_triton(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.1)
    with pytest.raises(ValueError, match="power-of-two"):
        decode_attention_triton(q[:1], kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.1)


def test_rejects_gqa_mismatch_and_batch_mismatch(paged_kv):
    kv = paged_kv([4], 2, 64, 16, F32, stale=0.0)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        prefill_attention_ref(torch.randn(4, 3, 64), kv.k_cache, kv.v_cache, kv.block_tables, cu,
                              kv.seq_lens, 0.1)
    with pytest.raises(ValueError, match="batch"):
        decode_attention_ref(torch.randn(2, 4, 64), kv.k_cache, kv.v_cache, kv.block_tables,
                             kv.seq_lens, 0.1)
