"""RoPE fused with the paged KV cache write: one launch per layer on the GPU path.

For token t at position positions[t] and slot slot_mapping[t]:

    q_out[t]               = rope(q[t])                      # returned, [T, Hq, D]
    k_cache[slot // BS, slot % BS] = rope(k[t])              # in place, skipped when slot < 0
    v_cache[slot // BS, slot % BS] = v[t]

with the rotation of `pdserve.kernels.rope` (neox style, float32 math, rounded to the input dtype).
Into an FP8 pool (kernels.kv_quant) the rotated k and v are quantized, one scale per head.
The torch reference is `apply_rope_ref` followed by `write_kv_cache_ref`, bit for bit.
"""

from __future__ import annotations

import torch

from pdserve.kernels._jit import TritonKernels, check_tensor, next_power_of_2
from pdserve.kernels import kv_quant
from pdserve.kernels.cache import _e4m3_bits  # noqa: F401 (JIT helper)
from pdserve.kernels.cache import _check_cache_shapes, fp8_kernel_args, fp8_store_views, write_kv_cache_ref
from pdserve.kernels.dispatch import kernel_backend
from pdserve.kernels.rope import _rope_rotate, _store_halves, apply_rope_ref  # noqa: F401 (JIT helpers)

tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rope_write_kv_kernel(
    q_ptr,  # [T, HQ, D], strides (stride_qt, stride_qh, 1)
    k_ptr,  # [T, HK, D], strides (stride_kt, stride_kh, 1)
    v_ptr,  # [T, HK, D], strides (stride_vt, stride_vh, 1)
    q_out_ptr,  # [T, HQ, D] contiguous
    k_cache_ptr,  # [NB, ROWS, HK, D] contiguous (ROWS = BS, or BS + scale rows for FP8: seen as uint8)
    v_cache_ptr,  # [NB, ROWS, HK, D] contiguous
    k_scale_ptr,  # FP8: the K pool seen as float32 (kernels.kv_quant); else unused
    v_scale_ptr,  # FP8: the V pool seen as float32; else unused
    positions_ptr,  # [T] int64
    slot_mapping_ptr,  # [T] int64, < 0: padding, nothing written
    cos_sin_ptr,  # [max_positions, D] float32 contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HQ,
    HK,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    K_IN_PLACE: tl.constexpr,  # also store the rotated k back into k (kernels.prefill_attention_dense)
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok)
    slot = tl.load(slot_mapping_ptr + tok)
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
    num_heads = tl.where(slot >= 0, HK, 0)  # padding token: write nothing
    mask = (offs_h < num_heads)[:, None]
    block = slot // BS
    offset = slot % BS
    dst = (block * ROWS + offset) * HK * (2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    y1, y2 = _rope_rotate(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                          mask, cos, sin, HALF)
    if K_IN_PLACE:
        _store_halves(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                      y1, y2, mask, HALF)
    src = v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    v1 = tl.load(src, mask=mask, other=0.0)
    v2 = tl.load(src + HALF, mask=mask, other=0.0)
    if FP8:
        scale_at = block * SCALE_BLOCK + SCALE_OFF + offs_h * BS + offset
        # the rotated k is rounded to the model dtype first, as the torch path stores it
        k1 = y1.to(k_ptr.dtype.element_ty).to(tl.float32)
        k2 = y2.to(k_ptr.dtype.element_ty).to(tl.float32)
        _store_fp8_halves(k_cache_ptr + dst, k_scale_ptr + scale_at, k1, k2, mask, offs_h < num_heads, HALF)
        _store_fp8_halves(v_cache_ptr + dst, v_scale_ptr + scale_at, v1.to(tl.float32), v2.to(tl.float32),
                          mask, offs_h < num_heads, HALF)
    else:
        _store_halves(k_cache_ptr + dst, y1, y2, mask, HALF)
        tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _store_fp8_halves(dst, scale_dst, x1, x2, mask, head_mask, HALF: tl.constexpr):
    """e4m3 with one scale per head row over both halves, dst uint8: bit for bit
    kernels.kv_quant.quantize, like kernels.cache._store_fp8."""
    amax = tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    scale = tl.where(scale > 0.0, scale, 1.0)
    s = tl.broadcast_to(scale[:, None], x1.shape)
    tl.store(dst, _e4m3_bits(tl.math.div_rn(x1, s)).to(tl.uint8), mask=mask)
    tl.store(dst + HALF, _e4m3_bits(tl.math.div_rn(x2, s)).to(tl.uint8), mask=mask)
    tl.store(scale_dst, scale, mask=head_mask)


_TRITON = TritonKernels(globals(), "_rope_rotate", "_store_halves", "_e4m3_bits", "_store_fp8_halves",
                       "_rope_write_kv_kernel")


def _check_inputs(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping) -> None:
    check_tensor("q", q, 3, _FLOAT_DTYPES)
    check_tensor("k", k, 3, (q.dtype,))
    check_tensor("v", v, 3, (q.dtype,))
    check_tensor("positions", positions, 1, (torch.int64,), contiguous=True)
    check_tensor("cos_sin", cos_sin, 2, (torch.float32,), contiguous=True)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,), contiguous=True)
    check_tensor("k_cache", k_cache, 4, (q.dtype, kv_quant.FP8_DTYPE), contiguous=True)
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), contiguous=True)
    _check_cache_shapes(k, v, k_cache, v_cache, slot_mapping)
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or positions.shape[0] != t:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"positions {tuple(positions.shape)}")
    if cos_sin.shape[1] != d:
        raise ValueError(f"cos_sin last dim {cos_sin.shape[1]} != head_dim {d}")


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, rotate_k: bool = False) -> torch.Tensor:
    _check_inputs(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    q_out, k_rot = apply_rope_ref(q, k, positions, cos_sin)
    write_kv_cache_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    if rotate_k:
        written = slot_mapping >= 0
        k[written] = k_rot[written]
    return q_out


def rope_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, rotate_k: bool = False) -> torch.Tensor:
    _check_inputs(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    t, hq, d = q.shape
    hk = k.shape[1]
    if d < 2 or d & (d - 1):
        raise ValueError(f"triton rope_write_kv needs a power-of-two head_dim, got {d}")
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t > 0:
        k_scale, v_scale, fp8_args = fp8_kernel_args(k_cache, v_cache)
        k_data, v_data = fp8_store_views(k_cache, v_cache)
        _TRITON.get("_rope_write_kv_kernel")[(t,)](
            q, k, v, q_out, k_data, v_data, k_scale, v_scale, positions, slot_mapping, cos_sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), hq, hk,
            HALF=d // 2, BLOCK_HQ=next_power_of_2(hq), BLOCK_HK=next_power_of_2(hk),
            **fp8_args, K_IN_PLACE=rotate_k, num_warps=4,
        )
    return q_out


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, rotate_k: bool = False) -> torch.Tensor:
    """Rotates q[T, Hq, D] (returned) and k[T, Hkv, D] by positions[T], and writes the rotated
    k and v[T, Hkv, D] into the paged cache at slot_mapping[T] (negative slots skipped).
    `rotate_k`: the rotated k also replaces k in place (rows with a slot), for attention
    that reads the step's own keys (kernels.prefill_attention_dense)."""
    if kernel_backend(q.device) == "triton":
        return rope_write_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, rotate_k)
    return rope_write_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, rotate_k)
