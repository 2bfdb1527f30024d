"""Write new K/V rows into the paged KV cache.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Token t goes to slot
slot_mapping[t] = block_id * block_size + offset; a negative slot (padding) is skipped.
An FP8 pool (float8_e4m3fn, kernels.kv_quant) has scale rows after each block's token rows;
writing to it quantizes each head's row and stores its scale.
"""

from __future__ import annotations

import torch

from kernels._jit import TritonKernels, check_tensor, next_power_of_2
from kernels import kv_quant
from kernels.dispatch import kernel_backend

tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_POOL_DTYPES = _FLOAT_DTYPES + (kv_quant.FP8_DTYPE,)


def _write_kv_kernel(
    k_ptr,  # [T, HK, D], strides (stride_kt, stride_kh, 1)
    v_ptr,  # [T, HK, D], strides (stride_vt, stride_vh, 1)
    k_cache_ptr,  # [NB, ROWS, HK, D] contiguous (ROWS = BS, or BS + scale rows for FP8)
    v_cache_ptr,  # [NB, ROWS, HK, D] contiguous
    k_scale_ptr,  # FP8: the K pool seen as float32 (kernels.kv_quant); else unused
    v_scale_ptr,  # FP8: the V pool seen as float32; else unused
    slot_mapping_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HK,
    D: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,  # FP8: float32 elements per block
    SCALE_OFF: tl.constexpr,  # FP8: float32 offset of the scales in a block
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    offs_h = tl.arange(0, BLOCK_HK)
    offs_d = tl.arange(0, D)
    num_heads = tl.where(slot >= 0, HK, 0)  # padding token: mask every head
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < D)
    row = offs_h[:, None] * D + offs_d[None, :]
    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    block = slot // BS
    offset = slot % BS
    dst = (block * ROWS + offset) * HK * D + row
    if FP8:
        _store_fp8(k_cache_ptr + dst, k_scale_ptr + block * SCALE_BLOCK + SCALE_OFF + offs_h * BS + offset,
                   k.to(tl.float32), mask, offs_h < num_heads)
        _store_fp8(v_cache_ptr + dst, v_scale_ptr + block * SCALE_BLOCK + SCALE_OFF + offs_h * BS + offset,
                   v.to(tl.float32), mask, offs_h < num_heads)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _store_fp8(dst, scale_dst, x, mask, head_mask):
    """Quantizes x [heads, D] (float32) to e4m3 with one scale per head row, amax / 448
    (kernels.kv_quant.quantize, the same arithmetic), and stores bytes and scales."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0.0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    tl.store(dst, q.to(dst.dtype.element_ty), mask=mask)
    tl.store(scale_dst, scale, mask=head_mask)


_TRITON = TritonKernels(globals(), "_write_kv_kernel", "_store_fp8")


def _check_cache_shapes(k, v, k_cache, v_cache, slot_mapping) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [T, Hkv, D]; got {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]; "
                         f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != k {tuple(k.shape[1:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _check_cache_shapes(k, v, k_cache, v_cache, slot_mapping)
    if kv_quant.is_fp8(k_cache):
        kv_quant.write_fp8_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = (slots >= 0).nonzero().squeeze(1)
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def write_kv_cache_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    check_tensor("k", k, 3, _FLOAT_DTYPES)
    check_tensor("v", v, 3, _FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, _POOL_DTYPES, contiguous=True)
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), contiguous=True)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,), contiguous=True)
    _check_cache_shapes(k, v, k_cache, v_cache, slot_mapping)
    T, HK, D = k.shape
    if D & (D - 1):
        raise ValueError(f"triton write_kv_cache needs a power-of-two head_dim, got {D}")
    if T > 0:
        k_scale, v_scale, fp8_args = fp8_kernel_args(k_cache, v_cache)
        _TRITON.get("_write_kv_kernel")[(T,)](
            k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), HK,
            D=D, BLOCK_HK=next_power_of_2(HK), **fp8_args, num_warps=4,
        )


def fp8_kernel_args(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(K scales, V scales, constexprs BS/ROWS/FP8/SCALE_BLOCK/SCALE_OFF) for kernels that
    read or write a pool of either kind; a bf16/fp32 pool passes itself as an unused pointer."""
    bs = kv_quant.pool_block_size(k_cache)
    if not kv_quant.is_fp8(k_cache):
        return k_cache, v_cache, dict(BS=bs, ROWS=bs, FP8=False, SCALE_BLOCK=0, SCALE_OFF=0)
    scale_block, scale_off = kv_quant.scale_geometry(k_cache)
    return (k_cache.view(torch.float32), v_cache.view(torch.float32),
            dict(BS=bs, ROWS=k_cache.shape[1], FP8=True, SCALE_BLOCK=scale_block, SCALE_OFF=scale_off))


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place: k_cache/v_cache[slot // BS, slot % BS] = k/v[t] for every slot >= 0."""
    if kernel_backend(k.device) == "triton":
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
