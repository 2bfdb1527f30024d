"""The FP8 (e4m3) paged KV pool: layout, quantization, and the torch reference path.

A pool of `block_size` (BS) tokens per block, Hkv heads of head_dim D, is one contiguous
float8_e4m3fn tensor [NB, BS + R, Hkv, D]: rows 0..BS-1 of a block hold the quantized K (or V)
of its tokens, and the R trailing rows hold their float32 scales, [Hkv, BS] per block
(R = ceil(4 * BS / D): one row at BS=16, D=64 or 128). Every block therefore carries its own
scales wherever it goes (prefix cache, KV transfer: a block is still one unit of bytes), and
a pool of 17 rows of one byte moves 17/32 of the bytes of a 16-row bf16 pool. (On the KV wire a
block of a bf16/fp32 pool goes with one more row, of per channel scales: see the end of this file.)

Scales are per token and per head (the finest "per-block" choice): scale = amax(|x|) / 448
over the head's D values, and the stored byte is round(x / scale) to e4m3. A token's scale is
fixed when its K/V is written, so decode never requantizes older tokens. Dequantized value:
fp8 * scale.

Bit for bit, on every device and in the Triton kernels (compiled or interpreted):
* both divisions are correctly rounded float32 divisions. The torch path divides in float64
  and rounds once to float32 (the same result: 53 >= 2 * 24 + 2 bits), because `t / 448.0`
  on CUDA multiplies by a rounded reciprocal and is 1 ulp off for about half the values;
* a scale that is 0 (amax 0, or amax / 448 underflowing) is 1;
* x / scale is clamped to [-448, 448] before the cast (so no NaN from overflow: torch's cast
  does not saturate, the GPU's cvt does);
* the cast rounds to nearest, ties to even, subnormals included. The kernels do it with integer
  bit arithmetic (pdserve/kernels/cache.py `_e4m3_bits`) instead of Triton's fp8 cast, whose
  interpreter rounds ties up and loses the carry into the exponent.

`pool_block_size` recovers BS from a pool of either kind; the attention kernels take such a
pool and read rows `block * (BS + R) + offset`.
"""

from __future__ import annotations

import torch


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_BYTES = 4  # float32
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")


def scale_rows(block_size: int, head_dim: int) -> int:
    """Trailing rows of an FP8 block that hold its [BS, Hkv] float32 scales."""
    return -(-SCALE_BYTES * block_size // head_dim)


def fp8_pool_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    if head_dim % SCALE_BYTES:
        raise ValueError(f"fp8 KV cache needs head_dim divisible by {SCALE_BYTES}, got {head_dim}")
    return (num_blocks, block_size + scale_rows(block_size, head_dim), num_kv_heads, head_dim)


def is_fp8(pool: torch.Tensor) -> bool:
    return pool.dtype == FP8_DTYPE


def pool_block_size(pool: torch.Tensor) -> int:
    """Tokens per block of a [NB, rows, Hkv, D] pool (rows = BS, or BS + scale rows for FP8)."""
    rows = pool.shape[1]
    if not is_fp8(pool):
        return rows
    return _fp8_block_size(rows, pool.shape[3])


def _fp8_block_size(rows: int, head_dim: int) -> int:
    """The power-of-two BS whose FP8 block (data and scale rows) has `rows` rows."""
    bs = 1
    while bs < rows:
        if bs + scale_rows(bs, head_dim) == rows:
            return bs
        bs *= 2
    raise ValueError(f"fp8 pool of {rows} rows per block (head_dim {head_dim}) matches no power-of-two block size")


def scale_geometry(pool: torch.Tensor) -> tuple[int, int]:
    """(float32 elements per block, float32 offset of the scales in a block): scale of (block b,
    offset o, head h) is pool.view(float32).flatten()[b * first + second + h * BS + o]."""
    _, rows, hk, d = pool.shape
    bs = pool_block_size(pool)
    return rows * hk * d // SCALE_BYTES, bs * hk * d // SCALE_BYTES


def split_pool(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an FP8 pool: data [NB, BS, Hkv, D] (float8) and scales [NB, BS, Hkv] (float32)."""
    nb, _, hk, d = pool.shape
    bs = pool_block_size(pool)
    start = bs * hk * d
    # stored [Hkv, BS] per block (a head's scales are contiguous for the kernels), seen as [BS, Hkv]
    scales = pool.view(nb, -1)[:, start:start + SCALE_BYTES * bs * hk].view(torch.float32).view(nb, hk, bs)
    return pool[:, :bs], scales.transpose(1, 2)


def fp8_scales(amax: torch.Tensor) -> torch.Tensor:
    """float32 amax [...] -> float32 scales: amax / 448 correctly rounded, 1 where that is 0.
    (IEEE float32 division is correctly rounded, and so equals the division in float64 rounded
    to float32: float64 has more than 2 x 24 + 2 bits, so the double rounding is exact.)"""
    if amax.device.type == "cpu":
        scale = amax.float() / FP8_MAX
    else:  # CUDA divides by a scalar as a product by its rounded reciprocal (1 ulp off for ~half)
        scale = (amax.double() / FP8_MAX).float()
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 x [..., D] / scale [..., 1] (correctly rounded), clamped to +-448, cast with
    round-to-nearest-even: what the kernels store."""
    if x.device.type == "cpu":
        q = x.float() / scale.float()  # correctly rounded (see fp8_scales)
    else:  # as the kernels divide (div.rn.f32), whatever torch's CUDA division does
        q = (x.double() / scale.double()).float()
    return q.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8 [..., D], float32 scales [...]), one scale per row of D."""
    xf = x.float()
    scale = fp8_scales(xf.abs().amax(dim=-1))
    return to_e4m3(xf, scale[..., None]), scale


_FP8_VALUES: dict[torch.device, torch.Tensor] = {}


_POW2: dict[torch.device, torch.Tensor] = {}


def _scale_by_pow2(x: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """x * 2**exp for float32 x and integer exp in [-127, 127] (broadcast), exactly as
    torch.ldexp rounds it: a product by a power of two that float32 holds exactly (2**-127 as a
    subnormal) is correctly rounded, like ldexp. The powers come from a table: torch.ldexp is slow on
    the CPU, the product much faster (docs/results.md, "Figures behind the code's choices")."""
    table = _POW2.get(x.device)
    if table is None:
        table = _POW2[x.device] = torch.tensor([2.0 ** e for e in range(-127, 128)], dtype=torch.float32,
                                               device=x.device)
    return x * torch.take(table, exp.to(torch.int64) + 127)


def fp8_to_float(data: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 ``data`` as float32 (exact). On the CPU through a table of the 256 byte values,
    faster there than torch's elementwise conversion (docs/results.md, "Figures behind the code's
    choices")."""
    if data.device.type != "cpu":
        return data.float()
    table = _FP8_VALUES.get(data.device)
    if table is None:
        table = _FP8_VALUES[data.device] = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    return torch.take(table, data.contiguous().view(torch.uint8).long())


def dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (fp8_to_float(data) * scales[..., None]).to(dtype)


def write_fp8_ref(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Quantizes k/v [T, Hkv, D] into the FP8 pools at slot_mapping[T] (negative: skipped)."""
    bs = pool_block_size(k_pool)
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = (slots >= 0).nonzero().squeeze(1)
        slots, k, v = slots[keep], k[keep], v[keep]
    block, offset = slots // bs, slots % bs
    for x, pool in ((k, k_pool), (v, v_pool)):
        data, scales = split_pool(pool)
        q, s = quantize(x)
        data.view(torch.uint8)[block, offset] = q.view(torch.uint8)
        scales[block, offset] = s


def gather_blocks(pool: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks `blocks` [n] of a pool as [n, BS, Hkv, D] in `dtype` (FP8 dequantized)."""
    if not is_fp8(pool):
        return pool.index_select(0, blocks)
    data, scales = split_pool(pool)
    return dequantize(data[blocks], scales[blocks], dtype)


def gather_slots(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Token slots `slots` [n] of a pool as [n, Hkv, D] in `dtype` (FP8 dequantized)."""
    hk, d = pool.shape[2], pool.shape[3]
    if not is_fp8(pool):
        return pool.view(-1, hk, d).index_select(0, slots)
    bs = pool_block_size(pool)
    data, scales = split_pool(pool)
    block, offset = slots // bs, slots % bs
    return dequantize(data[block, offset], scales[block, offset], dtype)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype for `--kv-cache-dtype` (auto: the model's dtype). ValueError names the flag."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "bf16":
        if model_dtype != torch.bfloat16:
            raise ValueError(f"kv_cache_dtype bf16 needs a bfloat16 model (--dtype bfloat16), not {model_dtype}")
        return torch.bfloat16
    return FP8_DTYPE


# ---- FP8 on the KV wire: a block of any pool, with per channel and per token scales ----------
#
# A wire block of BS tokens is uint8 [BS + R + 1, Hkv, D]:
# * rows 0..BS-1: e4m3 of x / (2^e[h, c] * s[t, h]);
# * R rows: the float32 token scales s, [Hkv, BS], where an FP8 pool keeps them;
# * 1 row: the channel exponents e, int8 [Hkv, D]: 2^e is the smallest power of two at or above the
#   channel's amax over the block's tokens (1 where that is 0).
# Dividing by a power of two is exact, so each channel is brought to [-1, 1] without rounding; the
# token scale then maps the token's largest value to 448. A channel much smaller than the token's
# largest (K has outlier channels) no longer falls to e4m3's subnormals, where it kept few bits.
# The FP8 pool (above) keeps token scales only: its blocks go on the wire as they are.
# `pack_blocks` / `unpack_blocks` dispatch like the other kernels (kernels.dispatch): on CUDA one
# Triton launch each (pdserve/kernels/kv_codec.py), on the CPU the torch ops of `pack_blocks_ref` /
# `unpack_blocks_ref`; both give the same bytes and values, bit for bit.


def fp8_block_rows(block_size: int, head_dim: int) -> int:
    """Rows of one block in FP8 on the wire (data rows, token scale rows, the channel exponent
    row): what a block of BS tokens takes, at one byte per row element."""
    return block_size + scale_rows(block_size, head_dim) + 1


def channel_exponents(x: torch.Tensor) -> torch.Tensor:
    """x [n, BS, Hkv, D] -> int8 e [n, Hkv, D]: 2^e >= the channel's amax over the block (0 where
    the amax is 0), clamped to int8."""
    amax = x.abs().amax(dim=1)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): 2^exp >= amax, exact powers give 2 * amax
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp))
    return exp.clamp(-127, 127).to(torch.int8)


def wire_block_size(rows: int, head_dim: int) -> int:
    """BS of a wire block of `rows` rows (`fp8_block_rows(BS, head_dim) == rows`, BS a power of two)."""
    return _fp8_block_size(rows - 1, head_dim)


def pack_blocks_ref(x: torch.Tensor) -> torch.Tensor:
    """`pack_blocks` in torch ops (the CPU path and the kernels' reference)."""
    *lead, bs, hk, d = x.shape
    n = 1
    for size in lead:
        n *= size
    xf = x.reshape(n, bs, hk, d).float()
    exp = channel_exponents(xf)
    y = _scale_by_pow2(xf, -exp[:, None].to(torch.int32))
    rows = fp8_block_rows(bs, d)
    out = torch.zeros(n, rows, hk, d, dtype=torch.uint8, device=x.device)
    data, scales = split_pool(out[:, :rows - 1].view(FP8_DTYPE))
    q, s = quantize(y)
    data.view(torch.uint8).copy_(q.view(torch.uint8))
    scales.copy_(s)
    out[:, rows - 1].copy_(exp.view(torch.uint8))
    return out.view(*lead, rows, hk, d)


def unpack_blocks_ref(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`unpack_blocks` in torch ops (the CPU path and the kernels' reference)."""
    *lead, rows, hk, d = raw.shape
    blocks = raw.reshape(-1, rows, hk, d)
    data, scales = split_pool(blocks[:, :rows - 1].view(FP8_DTYPE))
    exp = blocks[:, rows - 1].view(torch.int8).to(torch.int32)
    y = fp8_to_float(data) * scales[..., None]
    return _scale_by_pow2(y, exp[:, None]).to(dtype).view(*lead, data.shape[1], hk, d)
