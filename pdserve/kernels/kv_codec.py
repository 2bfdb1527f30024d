"""The FP8 KV wire codec: `pack_blocks` / `unpack_blocks` (and `warm_codec`), two Triton kernels on
CUDA and the torch reference of kernels.kv_quant (`pack_blocks_ref` / `unpack_blocks_ref`) elsewhere.

One launch each way, one program per (block, KV head), which holds the head's [BS, D] tile:

* pack: the channel exponents e[D] (frexp of the channel's amax over the block's tokens, from
  the float32 bits), y = x * 2^-e, the token scales s = amax(|y|) / 448 (correctly rounded, 1
  where 0), q = y / s (correctly rounded) to e4m3 (pdserve/kernels/cache.py `_e4m3_bits`); it stores the
  data rows, the scales where `split_pool` keeps them, the exponent row, and zeros in the rest of
  the scale rows, so the output needs no memset;
* unpack: e4m3 byte -> float32 (decoded from its bits), times s (a float32 product), times 2^e
  (exact), rounded to the pool's dtype (bfloat16 in integer arithmetic: the interpreter's cast
  truncates).

Both give the bytes and values of the torch reference (`pack_blocks_ref` / `unpack_blocks_ref`)
bit for bit, compiled or under TRITON_INTERPRET (tests/kernels/test_kv_codec_exact.py; its gpu
tests, compiled on a GPU, also for random bit patterns of every dtype and random wire bytes). Every
step is exact or one correctly rounded float32 operation: products (no sum follows them, so no FMA
contraction), `div_rn`, and integer bit arithmetic for frexp, the powers of two (2^-127 is a
subnormal) and the conversions; amaxes are integer maxima of the bits, so a NaN wins as in torch.
Inf and NaN inputs pack to torch's bytes too. One difference: a NaN value out of unpack (from a NaN
byte, 0x7F or 0xFF, which pack makes only from NaN) is NaN with other payload bits than torch's in
bfloat16 (torch's own differ between its CPU and CUDA conversions).

This module imports kernels.cache (for the `_e4m3_bits` helper) and kernels.kv_quant (the wire
block's layout and the reference); neither imports it.
"""

from __future__ import annotations

import contextlib

import torch

from pdserve.kernels._jit import TritonKernels, check_tensor, next_power_of_2
from pdserve.kernels.cache import _e4m3_bits  # noqa: F401 (JIT helper)
from pdserve.kernels.dispatch import kernel_backend
from pdserve.kernels.kv_quant import (SCALE_BYTES, fp8_block_rows, pack_blocks_ref, scale_rows, unpack_blocks_ref,
                                      wire_block_size)

tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OUT_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _pow2(k):
    """2^k as float32 for integer k in [-127, 127], built from its bits (2^-127 as a subnormal):
    the reference's table at k + 127. k = -128 (an exponent byte pack never writes) gives 2^127,
    the table's last entry, where torch.take wraps index -1."""
    normal = (tl.minimum(tl.maximum(k, -126), 127) + 127) << 23
    bits = tl.where(k >= -126, normal, tl.where(k == -127, 0x400000, 0x7F000000))
    return bits.to(tl.float32, bitcast=True)


def _pack_kernel(
    x_ptr,  # [N, BS, HK, D] float32/float16, or bfloat16 seen as int16; strides (sn, st, sh, 1)
    out_ptr,  # [N, ROWS, HK, D] uint8 contiguous
    scale_ptr,  # out seen as float32
    stride_xn,
    stride_xt,
    stride_xh,
    HK,
    BS: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,  # BS + scale rows + 1
    PAD: tl.constexpr,  # bytes per head after the scales in the scale rows (zeroed)
    BLOCK_BS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_BS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < BS
    mask_d = offs_d < D
    mask = mask_t[:, None] & mask_d[None, :]
    src = x_ptr + blk * stride_xn + head * stride_xh + offs_t[:, None] * stride_xt + offs_d[None, :]
    if IN_BF16:  # the bfloat16 bits are the float32's upper half (no reliance on the cast)
        x = (tl.load(src, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)

    # channel exponent: frexp(amax) from the bits. |x|'s bits order like the values (NaN above
    # inf), so the integer max is the amax. Normal: biased exponent E -> E - 126; subnormal
    # (mantissa m): bit length of m - 149, which clamps to -126 for m >= 2^22, else to -127;
    # 0, inf and NaN: 0 (frexp's exponent of inf and NaN is 0)
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)
    biased = amax >> 23
    e = tl.where(amax >= 0x400000, -126, -127)
    e = tl.where(biased > 0, tl.minimum(biased - 126, 127), e)
    e = tl.where((amax == 0) | (biased == 255), 0, e)
    y = x * _pow2(-e)[None, :]  # correctly rounded, like the reference's product by its table

    # token scale and the e4m3 bytes, as pdserve/kernels/cache.py `_store_fp8` computes them
    ymax = (tl.max(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(ymax, tl.full(ymax.shape, 448.0, tl.float32))
    scale = tl.where(scale > 0.0, scale, 1.0)
    q = tl.math.div_rn(y, tl.broadcast_to(scale[:, None], y.shape))

    block = blk * ROWS * HK * D
    tl.store(out_ptr + block + offs_t[:, None] * (HK * D) + head * D + offs_d[None, :],
             _e4m3_bits(q).to(tl.uint8), mask=mask)
    # scales [HK, BS] after the data rows (float32 index: a block is ROWS * HK * D / 4 of them)
    tl.store(scale_ptr + blk * ROWS * HK * (D // 4) + BS * HK * (D // 4) + head * BS + offs_t, scale, mask=mask_t)
    if PAD > 0:  # the scale rows' bytes after all heads' scales: this head's share of them
        offs_p = tl.arange(0, BLOCK_PAD)
        tl.store(out_ptr + block + BS * HK * D + 4 * BS * HK + head * PAD + offs_p,
                 tl.zeros([BLOCK_PAD], tl.uint8), mask=offs_p < PAD)
    tl.store(out_ptr + block + (ROWS - 1) * HK * D + head * D + offs_d, (e & 0xFF).to(tl.uint8), mask=mask_d)


def _e4m3_value(b):
    """The e4m3fn byte b (int32, 0..255) as float32, exactly: normal (exponent field E > 0)
    2^(E - 7) * (1 + m / 8), subnormal m * 2^-9, S.1111.111 NaN (with torch's bits: exponent all
    ones, the byte's mantissa kept). No fp8 cast: the interpreter's differs from the GPU's."""
    mag = b & 0x7F
    exp = mag >> 3
    man = mag & 7
    normal = ((exp + 120) << 23) | (man << 20)
    sub = (man.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    bits = tl.where(exp > 0, normal, sub)
    bits = tl.where(mag == 0x7F, 0x7FF00000, bits)
    return (bits | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


def _unpack_kernel(
    raw_ptr,  # [N, ROWS, HK, D] uint8, block stride stride_rn, the rest contiguous
    out_ptr,  # [N, BS, HK, D] contiguous: float32, float16, or bfloat16 seen as int16
    stride_rn,
    HK,
    BS: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_BS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_KIND: tl.constexpr,  # 0 float32, 1 float16, 2 bfloat16
):
    blk = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_BS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < BS
    mask_d = offs_d < D
    mask = mask_t[:, None] & mask_d[None, :]
    block = raw_ptr + blk * stride_rn
    data = tl.load(block + offs_t[:, None] * (HK * D) + head * D + offs_d[None, :], mask=mask, other=0)
    f = _e4m3_value(data.to(tl.int32))
    # the token scales, four little-endian bytes each (any alignment of raw)
    sp = block + BS * HK * D + (head * BS + offs_t) * 4
    s = tl.load(sp, mask=mask_t, other=0).to(tl.int32)
    s |= tl.load(sp + 1, mask=mask_t, other=0).to(tl.int32) << 8
    s |= tl.load(sp + 2, mask=mask_t, other=0).to(tl.int32) << 16
    s |= tl.load(sp + 3, mask=mask_t, other=0).to(tl.int32) << 24
    scale = s.to(tl.float32, bitcast=True)
    ev = tl.load(block + (ROWS - 1) * HK * D + head * D + offs_d, mask=mask_d, other=0).to(tl.int32)
    e = tl.where(ev >= 128, ev - 256, ev)  # the int8 exponent
    v = (f * scale[:, None]) * _pow2(e)[None, :]
    dst = out_ptr + ((blk * BS + offs_t[:, None]) * HK + head) * D + offs_d[None, :]
    if OUT_KIND == 2:  # round to nearest even on the bits; NaN -> quiet NaN of the same sign
        u = v.to(tl.int32, bitcast=True)
        a = u & 0x7FFFFFFF
        r = (tl.minimum(a, 0x7F800000) + 0x7FFF + ((a >> 16) & 1)) >> 16
        r = tl.where(a > 0x7F800000, 0x7FC0, r) | ((u >> 16) & 0x8000)
        tl.store(dst, r.to(tl.int16), mask=mask)
    elif OUT_KIND == 1:
        tl.store(dst, v.to(tl.float16), mask=mask)
    else:
        tl.store(dst, v, mask=mask)


_TRITON = TritonKernels(globals(), "_pow2", "_e4m3_bits", "_e4m3_value", "_pack_kernel", "_unpack_kernel")


def _launching_on(device: torch.device):
    """Triton launches on the current CUDA device's current stream: make it the tensors' device
    (a sender's thread may hold another GPU current), as torch ops would."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _warps(block_bs: int, block_d: int) -> int:
    """One warp per [16, 128] tile, at most 4: more warps per program timed slower both ways (the
    timings: docs/results.md, "Figures behind the code's choices")."""
    return max(1, min(4, block_bs * block_d // 2048))


def pack_blocks_triton(x: torch.Tensor) -> torch.Tensor:
    """`pack_blocks` in one launch (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if x.dim() < 3:
        raise ValueError(f"x must be [..., BS, Hkv, D], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}")
    *lead, bs, hk, d = x.shape
    if d % SCALE_BYTES:
        raise ValueError(f"the FP8 wire needs head_dim divisible by {SCALE_BYTES}, got {d}")
    n = 1
    for size in lead:
        n *= size
    rows = fp8_block_rows(bs, d)
    out = torch.empty(n, rows, hk, d, dtype=torch.uint8, device=x.device)
    if out.numel():
        xr = x.reshape(n, bs, hk, d)
        if xr.stride(-1) != 1:
            xr = xr.contiguous()
        check_tensor("x", xr, 4, _FLOAT_DTYPES)
        block_bs, block_d = next_power_of_2(bs), next_power_of_2(d)
        pad = scale_rows(bs, d) * d - SCALE_BYTES * bs
        with _launching_on(x.device):
            _TRITON.get("_pack_kernel")[(n, hk)](
                xr.view(torch.int16) if xr.dtype == torch.bfloat16 else xr, out, out.view(torch.float32),
                xr.stride(0), xr.stride(1), xr.stride(2), hk,
                BS=bs, D=d, ROWS=rows, PAD=pad, BLOCK_BS=block_bs, BLOCK_D=block_d,
                BLOCK_PAD=next_power_of_2(max(pad, 1)), IN_BF16=xr.dtype == torch.bfloat16,
                num_warps=_warps(block_bs, block_d),
            )
    return out.view(*lead, rows, hk, d)


def unpack_blocks_triton(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`unpack_blocks` in one launch (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if raw.dim() < 3 or raw.dtype != torch.uint8:
        raise ValueError(f"raw must be uint8 [..., BS + R + 1, Hkv, D], got {raw.dtype} {tuple(raw.shape)}")
    if dtype not in _OUT_KIND:
        raise ValueError(f"dtype must be one of {tuple(_OUT_KIND)}, got {dtype}")
    *lead, rows, hk, d = raw.shape
    bs = wire_block_size(rows, d)
    blocks = raw.reshape(-1, rows, hk, d)
    out = torch.empty(blocks.shape[0], bs, hk, d, dtype=dtype, device=raw.device)
    if out.numel():
        if blocks.stride(3) != 1 or blocks.stride(2) != d or blocks.stride(1) != hk * d:
            blocks = blocks.contiguous()
        block_bs, block_d = next_power_of_2(bs), next_power_of_2(d)
        with _launching_on(raw.device):
            _TRITON.get("_unpack_kernel")[(blocks.shape[0], hk)](
                blocks, out.view(torch.int16) if dtype == torch.bfloat16 else out, blocks.stride(0), hk,
                BS=bs, D=d, ROWS=rows, BLOCK_BS=block_bs, BLOCK_D=block_d, OUT_KIND=_OUT_KIND[dtype],
                num_warps=_warps(block_bs, block_d),
            )
    return out.view(*lead, bs, hk, d)


def pack_blocks(x: torch.Tensor) -> torch.Tensor:
    """Blocks x [..., BS, Hkv, D] of a bf16/fp16/fp32 pool -> uint8 [..., BS + R + 1, Hkv, D], the
    wire block of kernels.kv_quant. On CUDA one Triton launch, the same bytes as the torch
    reference `pack_blocks_ref`, which the CPU runs."""
    if kernel_backend(x.device) == "triton":
        return pack_blocks_triton(x)
    return pack_blocks_ref(x)


def unpack_blocks(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., BS + R + 1, Hkv, D] (what `pack_blocks` made) -> [..., BS, Hkv, D] in `dtype`.
    On CUDA one Triton launch, bit for bit `unpack_blocks_ref`."""
    if kernel_backend(raw.device) == "triton":
        return unpack_blocks_triton(raw, dtype)
    return unpack_blocks_ref(raw, dtype)


def warm_codec(pool: torch.Tensor) -> bool:
    """Compile the wire codec's kernels for blocks of ``pool`` ([NB, BS, Hkv, D], a float pool)
    by packing and unpacking two zero blocks, so that the first FP8 transfer does not pay the
    compilation (what it cost that request: docs/results.md, "KV precision chosen by the link").
    A transfer's blocks, gathered, have these strides whatever their count, so this is the
    specialization serving launches. Returns whether there was anything to compile (CUDA)."""
    if kernel_backend(pool.device) != "triton" or pool.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    *_, bs, hk, d = pool.shape
    if d % SCALE_BYTES:
        return False
    blocks = torch.zeros(2, bs, hk, d, dtype=pool.dtype, device=pool.device)
    unpack_blocks(pack_blocks(blocks), pool.dtype)
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    return True


def round_trip(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [T, Hkv, D] through the FP8 wire (`pack_blocks` then `unpack_blocks`, in blocks of
    `block_size` tokens, the last one padded): what a receiver of FP8 KV holds. Same dtype."""
    t, hk, d = x.shape
    nb = -(-t // block_size)
    padded = torch.zeros(nb * block_size, hk, d, dtype=x.dtype, device=x.device)
    padded[:t] = x
    back = unpack_blocks(pack_blocks(padded.view(nb, block_size, hk, d)), x.dtype)
    return back.reshape(nb * block_size, hk, d)[:t]
