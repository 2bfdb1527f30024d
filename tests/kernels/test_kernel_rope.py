import pytest
import torch

from pdserve.kernels.rope import apply_rope_ref, apply_rope_triton, rope_cos_sin_cache
from pdserve.config import RopeScaling

LLAMA3 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=256)


def hf_rotary(head_dim, theta, scaling, max_positions):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
                  "low_freq_factor": scaling.low_freq_factor,
                  "high_freq_factor": scaling.high_freq_factor,
                  "original_max_position_embeddings": scaling.original_max_position_embeddings}
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_positions, rope_parameters=params)
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("head_dim, theta, scaling", [
    (64, 10000.0, None), (128, 500000.0, LLAMA3), (32, 100000.0, None), (64, 500000.0, LLAMA3),
])
def test_cos_sin_cache_matches_hf(head_dim, theta, scaling):
    rotary = hf_rotary(head_dim, theta, scaling, 4096)
    positions = torch.arange(4096)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cache = rope_cos_sin_cache(head_dim, 4096, theta, scaling, device="cpu")
    assert cache.shape == (4096, head_dim) and cache.dtype == torch.float32
    half = head_dim // 2
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half], rtol=0, atol=0)
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_ref_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    head_dim, max_positions = 64, 300
    cache = rope_cos_sin_cache(head_dim, max_positions, 10000.0, None)
    positions = torch.tensor([0, 1, 17, 255, 299, 3])
    q = torch.randn(6, 6, head_dim).to(dtype)
    k = torch.randn(6, 2, head_dim).to(dtype)
    cos, sin = hf_rotary(head_dim, 10000.0, None, max_positions)(q, positions[None])
    # HF layout: [batch, heads, seq, dim]; ours: [tokens, heads, dim].
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = apply_rope_ref(q, k, positions, cache)
    assert q_out.dtype == dtype
    # HF rotates in the input dtype, we rotate in float32: equal in fp32, one rounding in bf16.
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), **tol)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), **tol)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_triton_matches_ref(head_dim, num_heads, num_kv_heads, needs_triton):
    torch.manual_seed(1)
    cache = rope_cos_sin_cache(head_dim, 64, 10000.0, LLAMA3)
    positions = torch.tensor([0, 5, 63, 7, 31])
    q = torch.randn(5, num_heads, head_dim)
    k = torch.randn(5, num_kv_heads, head_dim)
    got = apply_rope_triton(q, k, positions, cache)
    expected = apply_rope_ref(q, k, positions, cache)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=1e-6)


def test_triton_views_of_fused_qkv_fp16(needs_triton):
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    qkv = torch.randn(3, (num_heads + 2 * num_kv_heads) * head_dim).half()
    q = qkv[:, :num_heads * head_dim].view(3, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(3, num_kv_heads, head_dim)
    cache = rope_cos_sin_cache(head_dim, 16, 10000.0, None)
    positions = torch.tensor([15, 0, 9])
    got = apply_rope_triton(q, k, positions, cache)
    expected = apply_rope_ref(q, k, positions, cache)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-3, atol=1e-3)


def test_triton_rejects_non_power_of_two_head_dim():
    cache = rope_cos_sin_cache(48, 4, 10000.0, None)
    with pytest.raises(ValueError, match="power-of-two"):
        apply_rope_triton(torch.randn(1, 2, 48), torch.randn(1, 1, 48), torch.zeros(1, dtype=torch.int64), cache)
