"""SwiGLU activation: silu(gate) * up, with gate and up packed as x[:, :I] and x[:, I:].

Rounding follows HF LlamaMLP: silu(gate) is rounded to the input dtype before the multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels._jit import TritonKernels, cdiv, check_tensor
from pdserve.kernels.dispatch import kernel_backend

tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I], row stride stride_x
    out_ptr,  # [T, I] contiguous
    stride_x,
    I,  # noqa: E741 (the kernel's [T, I] shape name, as in the docstrings)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * I + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


_TRITON = TritonKernels(globals(), "_silu_and_mul_kernel")


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    out = F.silu(x[..., :inter])
    return out.mul_(x[..., inter:])


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    check_tensor("x", x, 2, _FLOAT_DTYPES)
    T, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x last dim must be even (gate and up halves), got {two_i}")
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T > 0 and inter > 0:
        block = 1024
        _TRITON.get("_silu_and_mul_kernel")[(T, cdiv(inter, block))](
            x, out, x.stride(0), inter, BLOCK=block, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[T, 2I] -> silu(x[:, :I]) * x[:, I:] of shape [T, I]."""
    if kernel_backend(x.device) == "triton":
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
