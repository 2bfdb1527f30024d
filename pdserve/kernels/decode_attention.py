"""Attention of one new query token per sequence over the paged KV cache (decode).

Triton path (flash-decoding): the context of each sequence is cut into `num_splits` chunks;
stage 1 runs one program per (sequence, kv head, chunk), holding all query heads of that
kv group in one tile so each K/V block is read once per group, and writes a partial output
plus its log-sum-exp; stage 2 merges the chunks. The torch path gathers every sequence's
blocks into a padded [B, Lmax, Hkv, D] tensor and runs one masked batched attention.
An FP8 pool (kernels.kv_quant) is dequantized on the fly: K's per-token scales multiply the
scores, V's the probabilities; the torch path dequantizes what it gathers.
"""

from __future__ import annotations

import functools
import math

import torch

from pdserve.kernels._jit import TritonKernels, cdiv, check_head_dim, check_tensor, next_power_of_2
from pdserve.kernels import kv_quant
from pdserve.kernels.cache import fp8_kernel_args
from pdserve.kernels.dispatch import kernel_backend

tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_SPLITS = 64
_MIN_TOKENS_PER_SPLIT = 128
# (BLOCK_N, num_warps, num_stages) of the split kernel on CUDA; see benchmarks/bench_kernels.py.
_CUDA_CONFIG = (64, 4, 3)
# FP8 pools: larger tiles, chosen by the sweep of benchmarks/bench_kv_fp8.py --attention-sweep (its
# figures: docs/results.md, "Figures behind the code's choices")
_CUDA_CONFIG_FP8 = (128, 4, 4)
_WAVES = 4  # programs per SM that the split count aims for


def _decode_split_kernel(
    q_ptr,  # [B, HQ, D], strides (stride_qb, stride_qh, 1)
    k_cache_ptr,  # [NB, ROWS, HK, D] contiguous (ROWS = BS, or BS + scale rows for FP8)
    v_cache_ptr,  # [NB, ROWS, HK, D] contiguous
    k_scale_ptr,  # FP8: the K pool seen as float32 (kernels.kv_quant); else unused
    v_scale_ptr,  # FP8: the V pool seen as float32; else unused
    block_tables_ptr,  # [B, MAX_BLOCKS] int32, row stride stride_bt
    seq_lens_ptr,  # [B] int32
    mid_out_ptr,  # [B, HQ, NUM_SPLITS, D] float32 contiguous; DIRECT: out [B, HQ, D] contiguous
    mid_lse_ptr,  # [B, HQ, NUM_SPLITS] float32 contiguous (log2 domain); DIRECT: unused
    stride_qb,
    stride_qh,
    stride_bt,
    qk_scale,  # softmax scale * log2(e)
    NUM_SPLITS,  # runtime: a new split count needs no recompilation
    HQ: tl.constexpr,
    HK: tl.constexpr,
    GROUP: tl.constexpr,  # HQ // HK
    BS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next_power_of_2(GROUP), at least 16 for tl.dot
    BLOCK_N: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    ROWS: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,  # FP8: float32 elements per block
    SCALE_OFF: tl.constexpr,  # FP8: float32 offset of the scales in a block
    DIRECT: tl.constexpr,  # one split: write the output itself, no partials and no merge
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Chunks are whole BLOCK_N tiles so that every split but the last is full.
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    n_begin = split * chunk
    n_end = tl.minimum(n_begin + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    for n_start in range(n_begin, n_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_end
        block_ids = tl.load(table_row + offs_n // BS, mask=n_mask, other=0).to(tl.int64)
        kv_off = ((block_ids * ROWS + offs_n % BS) * HK + kv_head) * D
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        if FP8:  # dequantize: the per-token scales multiply the scores and the probabilities
            scale_at = block_ids * SCALE_BLOCK + SCALE_OFF + kv_head * BS + offs_n % BS
            k_scale = tl.load(k_scale_ptr + scale_at, mask=n_mask, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_at, mask=n_mask, other=0.0)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if FP8:
            s = s * k_scale[None, :]
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a visible key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if FP8:
            p = p * v_scale[None, :]
        if IEEE_DOT:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    empty = l_i == 0.0  # this split starts past the end of the sequence
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DIRECT:  # the whole context was this program's: out is final (zeros for an empty sequence)
        tl.store(mid_out_ptr + (seq * HQ + heads)[:, None] * D + offs_d[None, :],
                 out.to(mid_out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        mid_row = (seq * HQ + heads) * NUM_SPLITS + split
        tl.store(mid_out_ptr + mid_row[:, None] * D + offs_d[None, :], out, mask=g_mask[:, None])
        tl.store(mid_lse_ptr + mid_row, lse, mask=g_mask)


def _decode_reduce_kernel(
    mid_out_ptr,  # [B, HQ, NUM_SPLITS, D] float32 contiguous
    mid_lse_ptr,  # [B, HQ, NUM_SPLITS] float32 contiguous (log2 domain)
    out_ptr,  # [B, HQ, D] contiguous
    NUM_SPLITS,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next_power_of_2(NUM_SPLITS)
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_mask = offs_s < NUM_SPLITS
    row = (seq * HQ + head) * NUM_SPLITS
    lse = tl.load(mid_lse_ptr + row + offs_s, mask=s_mask, other=float("-inf"))
    part = tl.load(mid_out_ptr + (row + offs_s)[:, None] * D + offs_d[None, :],
                   mask=s_mask[:, None], other=0.0)
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty sequence: output zeros, not NaN
    w = tl.exp2(lse - m)
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + (seq * HQ + head) * D + offs_d, out.to(out_ptr.dtype.element_ty))


_TRITON = TritonKernels(globals(), "_decode_split_kernel", "_decode_reduce_kernel",
                        do_not_specialize={"_decode_split_kernel": ("stride_bt", "NUM_SPLITS"),
                                           "_decode_reduce_kernel": ("NUM_SPLITS",)})


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    check_tensor("q", q, 3, _FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, (q.dtype, kv_quant.FP8_DTYPE), contiguous=True)
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), contiguous=True)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), contiguous=True)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    b, hq, d = q.shape
    hk = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {d}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hk})")
    if seq_lens.shape[0] != b or block_tables.shape[0] != b:
        raise ValueError(f"batch mismatch: q [{b}, ...], seq_lens {tuple(seq_lens.shape)}, "
                         f"block_tables {tuple(block_tables.shape)}")


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         num_splits: int | None = None) -> torch.Tensor:
    """Torch path; `num_splits` is accepted for signature parity and ignored."""
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    batch, hq, d = q.shape
    block_size, hk = kv_quant.pool_block_size(k_cache), k_cache.shape[2]
    if batch == 0:
        return torch.empty_like(q)
    max_len = int(seq_lens.max())
    num_blocks = max(cdiv(max_len, block_size), 1)
    # Gather whole blocks (contiguous BS*Hkv*D runs): [B, nblk, BS, Hkv, D] -> [B, L, Hkv, D].
    # Table entries past a sequence's own blocks may be padding (e.g. -1): read block 0 there.
    blocks = block_tables[:, :num_blocks].long()
    used = torch.arange(num_blocks, device=q.device)[None, :] * block_size < seq_lens[:, None]
    blocks = torch.where(used, blocks, 0).reshape(-1)
    length = num_blocks * block_size
    k = kv_quant.gather_blocks(k_cache, blocks, q.dtype).view(batch, length, hk, d)
    v = kv_quant.gather_blocks(v_cache, blocks, q.dtype).view(batch, length, hk, d)
    pad = torch.arange(length, device=q.device)[None, :] >= seq_lens[:, None]  # [B, L]
    # Slots past seq_len hold stale data, maybe NaN; 0 * NaN would leak through probs @ v.
    v = v.float().masked_fill_(pad[:, :, None, None], 0.0)
    qf = q.float().view(batch, hk, hq // hk, d) * scale  # [B, Hkv, G, D]
    scores = torch.matmul(qf, k.float().permute(0, 2, 3, 1))  # [B, Hkv, G, L]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.transpose(1, 2))  # [B, Hkv, G, D]
    return out.reshape(batch, hq, d).to(q.dtype)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough (batch x kv head x split) programs for _WAVES per SM (memory-level parallelism
    for small batches), at >= _MIN_TOKENS_PER_SPLIT tokens a split."""
    limit = max(1, min(_MAX_SPLITS, cdiv(max_context, _MIN_TOKENS_PER_SPLIT)))
    if device.type != "cuda":
        return min(2, limit)
    programs = batch * num_kv_heads
    return max(1, min(limit, cdiv(_WAVES * _sm_count(device.index or 0), programs)))


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            num_splits: int | None = None,
                            config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """`num_splits` defaults to a count bounded by the block table's width (no host sync, so
    it is fixed under CUDA graphs); `config` = (BLOCK_N, num_warps, num_stages)."""
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    batch, hq, d = q.shape
    block_size, hk = kv_quant.pool_block_size(k_cache), k_cache.shape[2]
    check_head_dim(d)
    out = torch.empty((batch, hq, d), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits is None:
        # Upper bound of any context from the block table: no device-to-host sync.
        num_splits = default_num_splits(batch, hk, block_tables.shape[1] * block_size, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    group = hq // hk
    direct = num_splits == 1  # e.g. large batches: no partials to merge, one launch
    if direct:
        mid_out, mid_lse = out, out
    else:
        mid_out = torch.empty((batch, hq, num_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    if config is None:
        config = ((_CUDA_CONFIG_FP8 if kv_quant.is_fp8(k_cache) else _CUDA_CONFIG) if q.is_cuda
                  else (16, 4, 1))
    block_n, num_warps, num_stages = config
    if q.dtype == torch.float32 and q.is_cuda:
        block_n = min(block_n, 32)
    k_scale, v_scale, fp8_args = fp8_kernel_args(k_cache, v_cache)
    del fp8_args["BS"]
    _TRITON.get("_decode_split_kernel")[(batch, hk, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, mid_out, mid_lse,
        q.stride(0), q.stride(1), block_tables.stride(0), float(scale) * math.log2(math.e),
        num_splits, HQ=hq, HK=hk, GROUP=group, BS=block_size, D=d,
        BLOCK_G=max(16, next_power_of_2(group)), BLOCK_N=block_n,
        IEEE_DOT=q.dtype == torch.float32, **fp8_args, DIRECT=direct, num_warps=num_warps,
        num_stages=num_stages,
    )
    if direct:
        return out
    _TRITON.get("_decode_reduce_kernel")[(batch, hq)](
        mid_out, mid_lse, out, num_splits,
        HQ=hq, D=d, BLOCK_S=max(next_power_of_2(num_splits), _MAX_SPLITS),  # one variant
        num_warps=4 if d >= 128 else 2,
    )
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     num_splits: int | None = None) -> torch.Tensor:
    """One query token per sequence, q[B, Hq, D], over the paged cache; returns out[B, Hq, D]."""
    if kernel_backend(q.device) == "triton":
        return decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                       num_splits)
    return decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)


# ---- torch path with a per-step gather plan (the CPU engine builds it once per forward) -----

def decode_gather_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(token slots [B * L], attention mask [B, 1, 1, L] or None, L): what
    `decode_attention_planned` needs, computed once per step for every layer. L is the
    longest context; shorter rows gather slot 0 for their tail and mask it out (no mask
    when every row is L long, as for a single stream)."""
    batch = block_tables.shape[0]
    length = max(int(seq_lens.max()) if batch else 0, 1)
    pos = torch.arange(length, device=block_tables.device)
    valid = pos[None, :] < seq_lens[:, None]
    blocks = block_tables[:, : cdiv(length, block_size)].long()
    slots = blocks[:, pos // block_size] * block_size + pos % block_size
    slots = torch.where(valid, slots, 0).reshape(-1)
    mask = None if bool(valid.all()) else valid[:, None, None, :]
    return slots, mask, length


def decode_attention_planned(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             plan: tuple[torch.Tensor, torch.Tensor | None, int], scale: float,
                             gather_free: bool | None = None) -> torch.Tensor:
    """`decode_attention_ref` with a precomputed plan. Eager: one SDPA call (GQA by
    `enable_gqa`) over the gathered K/V of each row, masked past its length. With
    `gather_free` (the default inside torch.compile), products and sums over the paged
    pools that inductor fuses with the indexing: each K/V row is read once and no gathered
    copy is made (about half the time of gather + SDPA at batch 16 on 2 cores)."""
    if gather_free is None:
        gather_free = torch.compiler.is_compiling() and not kv_quant.is_fp8(k_cache)
    if gather_free:
        return _decode_attention_gather_free(q, k_cache, v_cache, plan, scale)
    slots, mask, length = plan
    batch, hq, d = q.shape
    hk = k_cache.shape[2]
    k = kv_quant.gather_slots(k_cache, slots, q.dtype).view(batch, length, hk, d).transpose(1, 2)
    v = kv_quant.gather_slots(v_cache, slots, q.dtype).view(batch, length, hk, d).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(batch, hq, 1, d), k, v, attn_mask=mask, scale=scale, enable_gqa=True)  # also right for hq == hk
    return out.view(batch, hq, d)


def _decode_attention_gather_free(q, k_cache, v_cache, plan, scale):
    slots, mask, length = plan
    batch, hq, d = q.shape
    hk = k_cache.shape[2]
    group = hq // hk
    qg = q.view(batch, 1, hk, group, d).float()
    k = k_cache.view(-1, hk, d)[slots].view(batch, length, hk, 1, d)
    scores = (qg * k.float()).sum(-1) * scale  # [B, L, Hk, G]
    if mask is not None:
        scores = scores.masked_fill(~mask.view(batch, length, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=1)
    v = v_cache.view(-1, hk, d)[slots].view(batch, length, hk, 1, d)
    out = (probs[..., None] * v.float()).sum(1)  # [B, Hk, G, D]
    return out.view(batch, hq, d).to(q.dtype)
