"""Write new K/V rows into the paged KV cache.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Token t goes to slot
slot_mapping[t] = block_id * block_size + offset; a negative slot (padding) is skipped.
An FP8 pool (float8_e4m3fn, kernels.kv_quant) has scale rows after each block's token rows;
writing to it quantizes each head's row and stores its scale.
"""

from __future__ import annotations

import torch

from pdserve.kernels._jit import TritonKernels, check_tensor, next_power_of_2
from pdserve.kernels import kv_quant
from pdserve.kernels.dispatch import kernel_backend

tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_POOL_DTYPES = _FLOAT_DTYPES + (kv_quant.FP8_DTYPE,)


def _write_kv_kernel(
    k_ptr,  # [T, HK, D], strides (stride_kt, stride_kh, 1)
    v_ptr,  # [T, HK, D], strides (stride_vt, stride_vh, 1)
    k_cache_ptr,  # [NB, ROWS, HK, D] contiguous (ROWS = BS, or BS + scale rows for FP8: seen as uint8)
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
    """Quantizes x [heads, D] (float32) to e4m3 with one scale per head row, amax / 448, and
    stores the bytes (dst: uint8) and scales. Bit for bit kernels.kv_quant.quantize: correctly
    rounded divisions, scale 1 where it would be 0, clamp to +-448, round to nearest even."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    scale = tl.where(scale > 0.0, scale, 1.0)
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    tl.store(dst, _e4m3_bits(q).to(tl.uint8), mask=mask)
    tl.store(scale_dst, scale, mask=head_mask)


def _e4m3_bits(x):
    """float32 -> the e4m3fn byte (as int32) of x clamped to +-448, rounded to nearest, ties
    to even (NaN -> 0x7F with x's sign), in integer arithmetic: the same bits compiled on any
    GPU and under TRITON_INTERPRET, whose float -> fp8 cast rounds ties up and can drop the
    carry into the exponent. Torch's x.clamp(-448, 448).to(float8_e4m3fn) gives these bits."""
    u = x.to(tl.int32, bitcast=True)
    sign = tl.where(u < 0, 0x80, 0)
    a = u & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    a = tl.minimum(a, 0x43E00000)  # |x| <= 448 (bits of positive floats order like the values)
    # normal (|x| >= 2^-6): rebias the exponent (127 -> 7) and keep 3 mantissa bits, adding
    # just under half of the 20 dropped bits plus the kept lowest bit (ties to even); a carry
    # out of the mantissa moves into the exponent, as it should
    normal = (a - 0x3C000000 + 0x7FFFF + ((a >> 20) & 1)) >> 20
    # subnormal (|x| < 2^-6): |x| in units of 2^-9, rounded to an integer, ties to even
    e = tl.maximum(a >> 23, 1)
    m = tl.where((a >> 23) > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
    s = tl.minimum(141 - e, 31)  # |x| = m * 2^(e - 150) = (m >> s) * 2^-9 + remainder
    one = tl.zeros_like(s) + 1  # tensor << tensor: no reliance on int.__rlshift__ support
    q = m >> s
    rem = m & ((one << s) - 1)
    half = one << (s - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    bits = tl.where(a >= 0x3C800000, normal, q)
    return tl.where(is_nan, 0x7F, bits) | sign


_TRITON = TritonKernels(globals(), "_write_kv_kernel", "_store_fp8", "_e4m3_bits", "_e4m3_kernel")


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
        k_data, v_data = fp8_store_views(k_cache, v_cache)
        _TRITON.get("_write_kv_kernel")[(T,)](
            k, v, k_data, v_data, k_scale, v_scale, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), HK,
            D=D, BLOCK_HK=next_power_of_2(HK), **fp8_args, num_warps=4,
        )


def fp8_store_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools as the writing kernels take them: FP8 pools as uint8 (the kernels store the
    e4m3 bytes they compute, `_e4m3_bits`), other pools as they are."""
    if kv_quant.is_fp8(k_cache):
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    return k_cache, v_cache


def _e4m3_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _e4m3_bits(x).to(tl.uint8), mask=mask)


def e4m3_bytes_triton(x: torch.Tensor) -> torch.Tensor:
    """The e4m3 bytes (uint8) that the writing kernels store for float32 values x (already
    divided by their scale): for tests and tools/diag_fp8_kv.py."""
    check_tensor("x", x, 1, (torch.float32,), contiguous=True)
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if x.numel():
        block = 1024
        _TRITON.get("_e4m3_kernel")[(-(-x.numel() // block),)](x, out, x.numel(), BLOCK=block)
    return out


def e4m3_bytes_ref(x: torch.Tensor) -> torch.Tensor:
    """torch's bytes for the same values: clamp to +-448, then the float8_e4m3fn cast."""
    return x.float().clamp(-kv_quant.FP8_MAX, kv_quant.FP8_MAX).to(kv_quant.FP8_DTYPE).view(torch.uint8)


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
