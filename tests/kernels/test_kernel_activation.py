import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.activation import silu_and_mul_ref, silu_and_mul_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_llama_mlp_order(dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 2 * 40).to(dtype)
    gate, up = x[:, :40], x[:, 40:]
    torch.testing.assert_close(silu_and_mul_ref(x), F.silu(gate) * up, rtol=0, atol=0)


@pytest.mark.parametrize("inter", [40, 1100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_ref(inter, dtype, needs_triton):
    torch.manual_seed(1)
    x = torch.randn(3, 2 * inter).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **tol)


def test_triton_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(torch.randn(2, 7))
