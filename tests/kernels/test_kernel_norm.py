import pytest
import torch

from pdserve.kernels.norm import rms_norm_ref, rms_norm_triton


def hf_rms_norm(x, weight, eps):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(x.shape[-1], eps=eps).to(weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        return module(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ref_matches_hf_llama_rms_norm(dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 96).to(dtype)
    w = (torch.rand(96) + 0.5).to(dtype)
    expected = hf_rms_norm(x, w, 1e-5)
    got = rms_norm_ref(x, w, 1e-5)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_ref_fused_residual_matches_unfused():
    torch.manual_seed(0)
    x, r = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    w = torch.rand(64).bfloat16()
    normed, new_residual = rms_norm_ref(x, w, 1e-6, residual=r)
    torch.testing.assert_close(new_residual, x + r, rtol=0, atol=0)
    torch.testing.assert_close(normed, hf_rms_norm(x + r, w, 1e-6), rtol=0, atol=0)


@pytest.mark.parametrize("hidden", [64, 96, 577])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_matches_ref(hidden, dtype, with_residual, needs_triton):
    torch.manual_seed(1)
    x = torch.randn(5, hidden).to(dtype)
    w = (torch.rand(hidden) + 0.5).to(dtype)
    r = torch.randn(5, hidden).to(dtype) if with_residual else None
    got = rms_norm_triton(x, w, 1e-6, r)
    expected = rms_norm_ref(x, w, 1e-6, r)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=2e-3)
    if with_residual:
        torch.testing.assert_close(got[0], expected[0], **tol)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, expected, **tol)


def test_triton_strided_rows_and_promoted_weight(needs_triton):
    torch.manual_seed(2)
    x = torch.randn(4, 128)[:, :64]  # row stride 128
    w = torch.rand(64, dtype=torch.float32)
    got = rms_norm_triton(x.half(), w, 1e-6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, rms_norm_ref(x.half(), w, 1e-6), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


def test_triton_rejects_bad_shapes():
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="dims"):
        rms_norm_triton(torch.randn(8), torch.randn(8), 1e-6)
