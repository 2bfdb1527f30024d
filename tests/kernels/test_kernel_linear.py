"""`pdserve.kernels.linear` with weights in MKL's packed GEMM layout (the CPU fp32 path): equal to
`torch.nn.functional.linear` at every batch size from one packed copy, eager and inside
torch.compile; bad weights are refused."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import PackedWeight, linear, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without MKL")


@pytest.mark.parametrize("rows", [0, 1, 5, 16, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_dense(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)
    bias = torch.randn(96, generator=g) if with_bias else None
    packed = PackedWeight(weight)
    assert packed.shape == (96, 40)
    x = torch.randn(rows, 40, generator=g)
    got = linear(x, packed, bias)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_packed_linear_keeps_leading_dims_and_takes_strided_input():
    weight = torch.randn(24, 16)
    packed = PackedWeight(weight)
    x = torch.randn(3, 4, 32)[..., ::2]  # not contiguous
    torch.testing.assert_close(linear(x, packed), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_dense_weights_pass_through():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


def test_packed_linear_in_a_compiled_graph_any_batch():
    weight, bias = torch.randn(32, 16), torch.randn(32)
    packed = PackedWeight(weight)

    def f(x):
        return torch.relu(linear(x, packed, bias)) * 2

    compiled = torch.compile(f, fullgraph=True)
    for rows in (1, 3, 7):
        x = torch.randn(rows, 16)
        if rows > 1:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), f(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f(x), torch.relu(x @ weight.t() + bias) * 2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight", [torch.randn(4, 4).double(), torch.randn(4, 4).bfloat16(), torch.randn(4)],
                         ids=["float64", "bfloat16", "1-D"])
def test_packing_refuses_other_weights(weight):
    with pytest.raises(ValueError, match="2-D float32 CPU weight"):
        PackedWeight(weight)
