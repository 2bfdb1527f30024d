"""RMSNorm with an optional fused residual add (HF LlamaRMSNorm semantics).

    h = x (+ residual, rounded to x.dtype; that sum is the new residual)
    out = weight * (h.float() * rsqrt(mean(h.float()**2) + eps)).to(x.dtype)

The output dtype is `promote_types(x.dtype, weight.dtype)`, as in HF.
"""

from __future__ import annotations

import torch

from pdserve.kernels._jit import TritonKernels, check_tensor, next_power_of_2
from pdserve.kernels.dispatch import kernel_backend

tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rms_norm_kernel(
    x_ptr,  # [T, H], row stride stride_x
    residual_ptr,  # [T, H] contiguous; unused unless HAS_RESIDUAL
    weight_ptr,  # [H]
    out_ptr,  # [T, H] contiguous
    residual_out_ptr,  # [T, H] contiguous; unused unless HAS_RESIDUAL
    stride_x,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * H + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * H + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    normed = (xf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * H + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


_TRITON = TritonKernels(globals(), "_rms_norm_kernel")
_FUSED_RMS_NORM = hasattr(torch.nn.functional, "rms_norm")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and _FUSED_RMS_NORM:
        out = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)  # one op, same math
        return out if residual is None else (out, residual)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    check_tensor("x", x, 2, _FLOAT_DTYPES)
    T, H = x.shape
    check_tensor("weight", weight, 1, _FLOAT_DTYPES, contiguous=True)
    if weight.shape[0] != H:
        raise ValueError(f"weight has {weight.shape[0]} elements, x has hidden size {H}")
    if residual is not None:
        check_tensor("residual", residual, 2, (x.dtype,))
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        residual = residual.contiguous()
    out = torch.empty((T, H), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    if T > 0:
        block_h = next_power_of_2(H)
        _TRITON.get("_rms_norm_kernel")[(T,)](
            x, residual if residual is not None else x, weight, out, residual_out,
            x.stride(0), H, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_H=block_h,
            num_warps=min(max(block_h // 256, 1), 16),
        )
    return out if residual is None else (out, residual_out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm of x[T, H] by weight[H]; with `residual`, returns (normed, x + residual)."""
    if kernel_backend(x.device) == "triton":
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
