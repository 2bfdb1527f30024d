"""Fresh-prompt attention over the step's own K/V (kernels.prefill_attention_dense): the
Triton kernel (interpreted on CPU, with TMA descriptors and with plain loads) against its
torch reference and against the paged kernel on the same keys; the rotated-k write of
rope_write_kv; and when the dense path is taken."""

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import dispatch
from pdserve.kernels.dispatch import force_backend
from pdserve.kernels.prefill_attention import dense_applies, prefill_attention_ref
from pdserve.kernels.prefill_attention_dense import dense_prefill_attention_ref, dense_prefill_attention_triton
from pdserve.kernels.rope import apply_rope_ref, rope_cos_sin_cache
from pdserve.kernels.rope_cache import rope_write_kv_ref, rope_write_kv_triton


def fresh_step(lens, hq, hk, d, dtype, seed=0):
    """q, and k/v as strided views of one QKV tensor (the model's layout), plus cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q = qkv[:, :hq * d].reshape(t, hq, d).contiguous()
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, k, v, cu


def paged_copy(k, v, lens, block_size, seed=1):
    """The same keys and values scattered over a shuffled paged cache."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    order = torch.randperm(sum(per_seq), generator=gen)
    shape = (sum(per_seq), block_size) + tuple(k.shape[1:])
    k_cache, v_cache = torch.full(shape, float("nan"), dtype=k.dtype), torch.full(shape, float("nan"), dtype=k.dtype)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    start, at = 0, 0
    for b, n in enumerate(lens):
        blocks = order[at:at + per_seq[b]]
        tables[b, :per_seq[b]] = blocks.to(torch.int32)
        for i in range(n):
            blk, off = blocks[i // block_size], i % block_size
            k_cache[blk, off], v_cache[blk, off] = k[start + i], v[start + i]
        start, at = start + n, at + per_seq[b]
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


# (lens, hq, hk, d, dtype): tiles of 16 rows under the interpreter; lengths across tile edges
CASES = [
    pytest.param([1], 2, 2, 32, torch.float32, id="single-token"),
    pytest.param([5, 33, 1, 40], 4, 2, 16, torch.float32, id="varlen-gqa2"),
    pytest.param([16, 17, 15], 8, 2, 64, torch.float32, id="tile-edges-gqa4"),
    pytest.param([31, 9], 6, 2, 32, torch.float16, id="fp16-gqa3"),
    pytest.param([0, 12, 0], 4, 4, 32, torch.float32, id="empty-sequences"),
]


@pytest.mark.parametrize("lens, hq, hk, d, dtype", CASES)
@pytest.mark.parametrize("tma", [False, True], ids=["loads", "tma"])
def test_dense_triton_matches_ref_and_paged(lens, hq, hk, d, dtype, tma, needs_triton):
    q, k, v, cu = fresh_step(lens, hq, hk, d, dtype)
    scale = d ** -0.5
    want = dense_prefill_attention_ref(q, k, v, cu, scale)
    got = dense_prefill_attention_triton(q, k, v, cu, scale, tma=tma)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    # The paged kernel's reference on the same keys, spread over a shuffled cache
    k_cache, v_cache, tables, seq_lens = paged_copy(k, v, lens, 16)
    paged = prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq_lens, scale)
    torch.testing.assert_close(got, paged, **tol)


def test_dense_ref_against_naive_attention(naive_attention):
    q, k, v, cu = fresh_step([7, 3], 4, 2, 16, torch.float32, seed=3)
    out = dense_prefill_attention_ref(q, k, v, cu, 0.3)
    for b in range(2):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        torch.testing.assert_close(out[rows].double(), naive_attention(q[rows], k[rows], v[rows], 0.3),
                                   rtol=1e-5, atol=1e-5)


def test_dense_rejects_bad_inputs():
    q, k, v, cu = fresh_step([4, 4], 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="shape mismatch"):
        dense_prefill_attention_ref(q, k[:7], v[:7], cu, 1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        dense_prefill_attention_ref(q[:, :3], k, v, cu, 1.0)
    with pytest.raises(ValueError, match="contiguous heads"):
        dense_prefill_attention_ref(q, torch.zeros(8, 2, 32)[..., :16], v, cu, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        dense_prefill_attention_ref(q, k, v, cu.long(), 1.0)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_rope_write_kv_rotates_k_in_place(impl, request):
    if impl == "triton":
        request.getfixturevalue("needs_triton")
    fn = rope_write_kv_triton if impl == "triton" else rope_write_kv_ref
    q, k, v, _ = fresh_step([9], 4, 2, 32, torch.float32, seed=5)
    k_before = k.clone()
    positions = torch.arange(9, dtype=torch.int64)
    slots = torch.arange(9, dtype=torch.int64)
    slots[4] = -1  # a padding row: neither written nor rotated
    cos_sin = rope_cos_sin_cache(32, 64, 10000.0)
    caches = [torch.zeros(4, 4, 2, 32) for _ in range(2)]
    fn(q, k.clone(), v, positions, cos_sin, *caches, slots)  # rotate_k off: k untouched
    assert torch.equal(k, k_before)
    fn(q, k, v, positions, cos_sin, *caches, slots, rotate_k=True)
    _, k_rot = apply_rope_ref(q, k_before, positions, cos_sin)
    rows = slots >= 0
    torch.testing.assert_close(k[rows], k_rot[rows], rtol=1e-6, atol=1e-6)
    assert torch.equal(k[~rows], k_before[~rows])
    # the cache holds the same rotated keys
    torch.testing.assert_close(caches[0].view(-1, 2, 32)[slots[rows]], k_rot[rows], rtol=1e-6, atol=1e-6)


def test_dense_applies():
    """The process's prefill attention setting (dispatch.configure; PDSERVE_PREFILL_ATTENTION at
    the engine's start: tests/engine/test_prefill_dense_model.py)."""
    q = torch.zeros(2, 4, 16)
    cache = torch.zeros(1, 16, 2, 16)
    try:
        dispatch.configure(prefill_attention="auto")
        assert not dense_applies(q, cache)  # auto: CUDA only
        with force_backend("triton"):
            assert not dense_applies(q, cache)
            dispatch.configure(prefill_attention="dense")
            assert dense_applies(q, cache)
            assert not dense_applies(q, cache.to(kernels.FP8_DTYPE))  # an FP8 cache: the decode reads quantized keys
            dispatch.configure(prefill_attention="paged")
            assert not dense_applies(q, cache)
            with pytest.raises(ValueError, match="prefill attention must be auto, dense or paged; got 'flash'"):
                dispatch.configure(prefill_attention="flash")
        dispatch.configure(prefill_attention="dense")
        assert not dense_applies(q, cache)  # the torch backend never takes it
    finally:
        dispatch.configure()
