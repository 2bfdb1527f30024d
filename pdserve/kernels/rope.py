"""Rotary position embedding, neox / rotate_half style (the HF Llama convention).

    cos_sin[p] = cat(cos(p * inv_freq), sin(p * inv_freq))       # [D], float32
    out[:D/2] = x1 * cos - x2 * sin,  out[D/2:] = x2 * cos + x1 * sin

with x1 = x[:D/2], x2 = x[D/2:]. Rotation is computed in float32 and rounded to the input
dtype. `apply_rope` is out of place on both backends: it returns new q and k tensors.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from pdserve.kernels._jit import TritonKernels, check_tensor, next_power_of_2
from pdserve.kernels.dispatch import kernel_backend


class RopeScaling(Protocol):
    """Llama 3 frequency scaling as the kernels read it (the engine's config.RopeScaling has
    these fields; kernels know nothing of the engine)."""

    @property
    def factor(self) -> float: ...
    @property
    def low_freq_factor(self) -> float: ...
    @property
    def high_freq_factor(self) -> float: ...
    @property
    def original_max_position_embeddings(self) -> int: ...


tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] float32, as HF computes them (default or llama3)."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even integer, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.high_freq_factor == scaling.low_freq_factor:
        raise ValueError("rope scaling: high_freq_factor must differ from low_freq_factor")
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                       scaling: RopeScaling | None = None,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """cat(cos, sin) of every position: Tensor[max_positions, head_dim] float32."""
    if max_positions <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
    positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


def _rope_rotate(src, mask, cos, sin, HALF: tl.constexpr):
    """Loads heads [H, 2 * HALF] at pointer block `src` and returns both rotated halves in
    float32 (neox style). Shared with the fused RoPE + KV-write kernel (kernels.rope_cache)."""
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
    y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
    return y1, y2


def _store_halves(dst, y1, y2, mask, HALF: tl.constexpr):
    """Stores the halves at pointer block `dst`, rounded to its element type."""
    tl.store(dst, y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(dst.dtype.element_ty), mask=mask)


def _rope_kernel(
    q_ptr,  # [T, HQ, D], strides (stride_qt, stride_qh, 1)
    k_ptr,  # [T, HK, D], strides (stride_kt, stride_kh, 1)
    q_out_ptr,  # [T, HQ, D] contiguous, q's dtype
    k_out_ptr,  # [T, HK, D] contiguous, k's dtype
    positions_ptr,  # [T] int64
    cos_sin_ptr,  # [max_positions, D] float32 contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    HQ,
    HK,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + offs_d)[None, :]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + offs_d)[None, :]

    offs_h = tl.arange(0, BLOCK_HQ)
    mask = (offs_h < HQ)[:, None]
    y1, y2 = _rope_rotate(q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                          mask, cos, sin, HALF)
    _store_halves(q_out_ptr + tok * HQ * (2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :],
                  y1, y2, mask, HALF)

    offs_h = tl.arange(0, BLOCK_HK)
    mask = (offs_h < HK)[:, None]
    y1, y2 = _rope_rotate(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                          mask, cos, sin, HALF)
    _store_halves(k_out_ptr + tok * HK * (2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :],
                  y1, y2, mask, HALF)


_TRITON = TritonKernels(globals(), "_rope_rotate", "_store_halves", "_rope_kernel")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions)[:, None, :]  # [T, 1, D]
    cos, sin = cs[..., :half], cs[..., half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor("q", q, 3, _FLOAT_DTYPES)
    check_tensor("k", k, 3, (q.dtype,))
    check_tensor("positions", positions, 1, (torch.int64,), contiguous=True)
    check_tensor("cos_sin", cos_sin, 2, (torch.float32,), contiguous=True)
    T, HQ, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or positions.shape[0] != T:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"positions {tuple(positions.shape)}")
    if cos_sin.shape[1] != D:
        raise ValueError(f"cos_sin last dim {cos_sin.shape[1]} != head_dim {D}")
    if D < 2 or D & (D - 1):
        raise ValueError(f"triton rope needs a power-of-two head_dim, got {D}")
    HK = k.shape[1]
    q_out = torch.empty((T, HQ, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, HK, D), dtype=k.dtype, device=k.device)
    if T > 0:
        _TRITON.get("_rope_kernel")[(T,)](
            q, k, q_out, k_out, positions, cos_sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), HQ, HK,
            HALF=D // 2, BLOCK_HQ=next_power_of_2(HQ), BLOCK_HK=next_power_of_2(HK),
            num_warps=4,
        )
    return q_out, k_out


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q[T, Hq, D] and k[T, Hkv, D] by positions[T] (int64); returns new tensors."""
    if kernel_backend(q.device) == "triton":
        return apply_rope_triton(q, k, positions, cos_sin)
    return apply_rope_ref(q, k, positions, cos_sin)


# ---- torch path with per-step tables (the CPU engine builds them once per forward) ----------

def rope_tables(positions: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed_sin), each [T, 1, D] float32, for `apply_rope_tables`: gathered once per
    step instead of once per layer."""
    half = cos_sin.shape[1] // 2
    cs = cos_sin.index_select(0, positions)
    cos, sin = cs[:, :half], cs[:, half:]
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


def apply_rope_tables(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x[T, H, D] rotated: x * cos + cat(x2, x1) * signed_sin, the same arithmetic as
    `apply_rope_ref` (float32 inputs are not copied)."""
    half = x.shape[-1] // 2
    xf = x.float()
    swapped = torch.cat((xf[..., half:], xf[..., :half]), -1)
    return (xf * cos + swapped * signed_sin).to(x.dtype)
