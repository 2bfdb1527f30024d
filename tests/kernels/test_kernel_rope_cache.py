"""RoPE fused with the KV cache write: the reference equals rope then write, and the Triton
kernel (interpreted on CPU) equals the reference."""

import pytest
import torch

from pdserve.kernels.cache import write_kv_cache_ref
from pdserve.kernels.rope import apply_rope_ref, rope_cos_sin_cache
from pdserve.kernels.rope_cache import rope_write_kv_ref, rope_write_kv_triton


def make(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen)
    slots = torch.randperm(4 * block_size, generator=gen)[:num_tokens]
    slots[1::3] = -1  # padding rows write nothing
    shape = (4, block_size, num_kv_heads, head_dim)
    return q, k, v, positions, slots, shape


def test_ref_is_rope_then_write():
    q, k, v, positions, slots, shape = make(7, 4, 2, 32, 16, torch.float32)
    cos_sin = rope_cos_sin_cache(32, 64, 10000.0)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    q_out = rope_write_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    q_rot, k_rot = apply_rope_ref(q, k, positions, cos_sin)
    k_want, v_want = torch.zeros(shape), torch.zeros(shape)
    write_kv_cache_ref(k_rot, v, k_want, v_want, slots)
    assert torch.equal(q_out, q_rot)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (4, 4, 32, 16), (6, 2, 64, 32), (8, 1, 128, 16),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_ref(num_heads, num_kv_heads, head_dim, block_size, dtype, needs_triton):
    q, k, v, positions, slots, shape = make(9, num_heads, num_kv_heads, head_dim, block_size, dtype)
    cos_sin = rope_cos_sin_cache(head_dim, 64, 500000.0)
    caches = [torch.full(shape, 7.0, dtype=dtype) for _ in range(4)]
    got = rope_write_kv_triton(q, k, v, positions, cos_sin, caches[0], caches[1], slots)
    want = rope_write_kv_ref(q, k, v, positions, cos_sin, caches[2], caches[3], slots)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)
    assert torch.equal(caches[1], caches[3])  # v is copied, not computed


def test_rejects_cache_dtype_mismatch():
    q, k, v, positions, slots, shape = make(3, 4, 2, 32, 16, torch.float32)
    cos_sin = rope_cos_sin_cache(32, 64, 10000.0)
    with pytest.raises(ValueError, match="k_cache"):
        rope_write_kv_ref(q, k, v, positions, cos_sin, torch.zeros(shape, dtype=torch.float16),
                          torch.zeros(shape, dtype=torch.float16), slots)
