"""Write new K/V rows into the paged KV cache.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Token t goes to slot
slot_mapping[t] = block_id * block_size + offset; a negative slot (padding) is skipped.
"""

from __future__ import annotations

import torch

from kernels._jit import TritonKernels, check_tensor, next_power_of_2
from kernels.dispatch import kernel_backend

tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _write_kv_kernel(
    k_ptr,  # [T, HK, D], strides (stride_kt, stride_kh, 1)
    v_ptr,  # [T, HK, D], strides (stride_vt, stride_vh, 1)
    k_cache_ptr,  # [NB, BS, HK, D] contiguous
    v_cache_ptr,  # [NB, BS, HK, D] contiguous
    slot_mapping_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HK,
    D: tl.constexpr,
    BLOCK_HK: tl.constexpr,
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
    dst = slot * HK * D + row
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


_TRITON = TritonKernels(globals(), "_write_kv_kernel")


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
    check_tensor("k_cache", k_cache, 4, _FLOAT_DTYPES, contiguous=True)
    check_tensor("v_cache", v_cache, 4, _FLOAT_DTYPES, contiguous=True)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,), contiguous=True)
    _check_cache_shapes(k, v, k_cache, v_cache, slot_mapping)
    T, HK, D = k.shape
    if D & (D - 1):
        raise ValueError(f"triton write_kv_cache needs a power-of-two head_dim, got {D}")
    if T > 0:
        _TRITON.get("_write_kv_kernel")[(T,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), HK,
            D=D, BLOCK_HK=next_power_of_2(HK), num_warps=4,
        )


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place: k_cache/v_cache[slot // BS, slot % BS] = k/v[t] for every slot >= 0."""
    if kernel_backend(k.device) == "triton":
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
