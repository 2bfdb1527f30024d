import pytest
import torch

from pdserve.kernels.cache import write_kv_cache_ref, write_kv_cache_triton


def make(num_tokens, block_size, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 6
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1::3] = -1  # padding tokens
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return k, v, torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), slots


def test_ref_matches_explicit_loop():
    k, v, k_cache, v_cache, slots = make(7, 16, 2, 32, torch.float32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // 16, slot % 16] = k[t]
            expected_v[slot // 16, slot % 16] = v[t]
    write_kv_cache_ref(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(1, 64), (3, 128), (2, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_ref(block_size, num_kv_heads, head_dim, dtype, needs_triton):
    k, v, k_cache, v_cache, slots = make(9, block_size, num_kv_heads, head_dim, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    write_kv_cache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_triton_strided_kv_from_fused_projection(needs_triton):
    kv = torch.randn(4, 2, 2, 64)  # [T, (k|v), Hkv, D]
    k_cache, v_cache = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    slots = torch.tensor([0, 17, -1, 31])
    write_kv_cache_triton(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 1], kv[1, 0]) and torch.equal(v_cache[1, 15], kv[3, 1])
    assert k_cache.abs().sum(dim=(1, 2, 3)).ne(0).tolist() == [True, True]


def test_rejects_mismatched_shapes():
    k = torch.randn(2, 2, 64)
    cache = torch.zeros(2, 16, 3, 64)
    with pytest.raises(ValueError, match="heads"):
        write_kv_cache_ref(k, k, cache, cache.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_triton(k, k, torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64),
                              torch.tensor([0, 1, 2]))
