"""Causal attention for a varlen batch of prefill chunks over the paged KV cache.

Sequence b owns query rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1; they sit at positions
seq_lens[b] - q_len_b .. seq_lens[b] - 1 (a cached prefix precedes them when
q_len_b < seq_lens[b]). Keys/values of positions 0 .. seq_lens[b]-1 are already in the cache,
position p in block block_tables[b, p // BS] at offset p % BS. Query at position p sees keys
0..p. GQA: query head h reads kv head h // (Hq / Hkv). FP8 pools (kernels.kv_quant) are
dequantized on the fly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pdserve.kernels._jit import TritonKernels, cdiv, check_head_dim, check_tensor, next_power_of_2
from pdserve.kernels import kv_quant
from pdserve.kernels.cache import fp8_kernel_args
from pdserve.kernels.dispatch import kernel_backend, settings
from pdserve.kernels.prefill_attention_dense import _query_tile, _softmax_update  # noqa: F401 (JIT helpers)
from pdserve.kernels.prefill_attention_dense import dense_prefill_attention_triton


tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _prefill_tile_update(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row, offs_d,
                         kv_head, n_start, m_i, l_i, acc, q_pos, kv_end, qk_scale,
                         HK: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                         BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE_DOT: tl.constexpr,
                         ROWS: tl.constexpr, FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                         SCALE_OFF: tl.constexpr):
    """One BLOCK_N tile of keys: online-softmax update of (m_i, l_i, acc), log2 domain.
    FP8 pools: K's per-token scales multiply the scores, V's the probabilities."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = offs_n < kv_end
        block_ids = tl.load(table_row + offs_n // BS, mask=n_mask, other=0).to(tl.int64)
    else:
        block_ids = tl.load(table_row + offs_n // BS).to(tl.int64)
    kv_off = ((block_ids * ROWS + offs_n % BS) * HK + kv_head) * D
    if MASKED:
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :])
    if FP8:
        scale_at = block_ids * SCALE_BLOCK + SCALE_OFF + kv_head * BS + offs_n % BS
        if MASKED:
            k_scale = tl.load(k_scale_ptr + scale_at, mask=n_mask, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_at, mask=n_mask, other=0.0)
        else:
            k_scale = tl.load(k_scale_ptr + scale_at)
            v_scale = tl.load(v_scale_ptr + scale_at)
        k = k.to(q.dtype)
    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if FP8:
        s = s * k_scale[None, :]
    visible = offs_n[None, :] <= q_pos[:, None]  # used only when MASKED
    if MASKED:
        visible = visible & n_mask[None, :]
    m_new, l_i, acc, p = _softmax_update(s, visible, m_i, l_i, acc, qk_scale, MASKED)
    if MASKED:
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :])
    if FP8:
        v = v.to(q.dtype)
        p = p * v_scale[None, :]
    if IEEE_DOT:
        acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


def _prefill_attention_kernel(
    q_ptr,  # [T, HQ, D], strides (stride_qt, stride_qh, 1)
    k_cache_ptr,  # [NB, ROWS, HK, D] contiguous (ROWS = BS, or BS + scale rows for FP8)
    v_cache_ptr,  # [NB, ROWS, HK, D] contiguous
    k_scale_ptr,  # FP8: the K pool seen as float32 (kernels.kv_quant); else unused
    v_scale_ptr,  # FP8: the V pool seen as float32; else unused
    block_tables_ptr,  # [B, MAX_BLOCKS] int32, row stride stride_bt
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [T, HQ, D] contiguous
    stride_qt,
    stride_qh,
    stride_bt,
    qk_scale,  # softmax scale * log2(e)
    B,
    HQ,
    HK: tl.constexpr,
    GROUP: tl.constexpr,  # HQ // HK
    BS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,  # next_power_of_2(B)
    IEEE_DOT: tl.constexpr,  # exact fp32 dots (no tf32) for float32 inputs
    ROWS: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    SCALE_OFF: tl.constexpr,
):
    seq, q_begin, q_len, m_start = _query_tile(cu_seqlens_q_ptr, B, BLOCK_M, BLOCK_B)
    head = tl.program_id(1)
    if m_start < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len
        kv_head = head // GROUP
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        m_mask = offs_m < q_len
        rows = (q_begin + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None], other=0.0)
        q_pos = context_len + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        # Keys before the tile's first query position are visible to all its rows: whole
        # BLOCK_N tiles of them need no mask. The rest, up to the last row's position, do.
        kv_end = context_len + tl.minimum(m_start + BLOCK_M, q_len)
        full_end = ((context_len + m_start + 1) // BLOCK_N) * BLOCK_N
        for n_start in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile_update(
                q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row, offs_d, kv_head,
                n_start, m_i, l_i, acc, q_pos, kv_end, qk_scale,
                HK, BS, D, BLOCK_N, False, IEEE_DOT, ROWS, FP8, SCALE_BLOCK, SCALE_OFF)
        for n_start in range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile_update(
                q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row, offs_d, kv_head,
                n_start, m_i, l_i, acc, q_pos, kv_end, qk_scale,
                HK, BS, D, BLOCK_N, True, IEEE_DOT, ROWS, FP8, SCALE_BLOCK, SCALE_OFF)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(out_ptr + rows[:, None] * (HQ * D) + head * D + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


_TRITON = TritonKernels(globals(), "_query_tile", "_softmax_update", "_prefill_tile_update",
                        "_prefill_attention_kernel",
                        do_not_specialize={"_prefill_attention_kernel": ("stride_bt", "B")})


def _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens) -> None:
    check_tensor("q", q, 3, _FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, (q.dtype, kv_quant.FP8_DTYPE), contiguous=True)
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), contiguous=True)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), contiguous=True)
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), contiguous=True)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hk = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {d}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hk})")
    b = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != b + 1 or block_tables.shape[0] != b:
        raise ValueError(f"batch mismatch: seq_lens [{b}], cu_seqlens_q {tuple(cu_seqlens_q.shape)}, "
                         f"block_tables {tuple(block_tables.shape)}")


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    block_size, hk = kv_quant.pool_block_size(k_cache), k_cache.shape[2]
    hq = q.shape[1]
    out = torch.empty((q.shape[0], hq, q.shape[2]), dtype=q.dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {b}: {q_len} query tokens but seq_len {seq_len}")
        blocks = block_tables[b, :cdiv(seq_len, block_size)].long()
        k = kv_quant.gather_blocks(k_cache, blocks, q.dtype).flatten(0, 1)[:seq_len]  # [S, Hkv, D]
        v = kv_quant.gather_blocks(v_cache, blocks, q.dtype).flatten(0, 1)[:seq_len]
        qb = q[cu[b]:cu[b + 1]].transpose(0, 1)  # [Hq, L, D]
        kb, vb = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, S, D]
        if hk != hq:
            kb = kb.repeat_interleave(hq // hk, dim=0)
            vb = vb.repeat_interleave(hq // hk, dim=0)
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
        out[cu[b]:cu[b + 1]] = o.transpose(0, 1)
    return out


# (BLOCK_M, BLOCK_N, num_warps, num_stages) on CUDA, chosen by benchmarks/bench_kernels.py --sweep
# (where it ran: docs/results.md, "Figures behind the code's choices"): wide key tiles with 8 warps
# up to ~4k query tokens, one warpgroup over 128 rows with 64-key tiles beyond that.
_CUDA_CONFIGS = {
    128: ((4096, (128, 128, 8, 3)), (None, (128, 64, 4, 3))),
    64: ((None, (128, 64, 8, 3)),),
}
_CUDA_FALLBACK = (64, 64, 4, 2)
_INTERPRETER_CONFIG = (16, 16, 4, 1)


def prefill_config(head_dim: int, is_cuda: bool, num_tokens: int = 0) -> tuple[int, int, int, int]:
    """The tile configuration for `num_tokens` query rows of `head_dim`."""
    if not is_cuda:
        return _INTERPRETER_CONFIG
    for max_tokens, config in _CUDA_CONFIGS.get(head_dim, ((None, _CUDA_FALLBACK),)):
        if max_tokens is None or num_tokens <= max_tokens:
            return config
    return _CUDA_FALLBACK


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             seq_lens: torch.Tensor, scale: float,
                             config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """`config` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the tuned default."""
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    T, hq, d = q.shape
    block_size, hk = kv_quant.pool_block_size(k_cache), k_cache.shape[2]
    check_head_dim(d)
    batch = seq_lens.shape[0]
    out = torch.empty((T, hq, d), dtype=q.dtype, device=q.device)
    if T == 0 or batch == 0:
        return out
    block_m, block_n, num_warps, num_stages = config or prefill_config(d, q.is_cuda, T)
    if q.dtype == torch.float32 and q.is_cuda:  # fp32 tiles take twice the shared memory
        block_m, block_n, num_stages = min(block_m, 64), min(block_n, 32), min(num_stages, 2)
    grid = (T // block_m + batch, hq)
    k_scale, v_scale, fp8_args = fp8_kernel_args(k_cache, v_cache)
    del fp8_args["BS"]
    _TRITON.get("_prefill_attention_kernel")[grid](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens, out,
        q.stride(0), q.stride(1), block_tables.stride(0),
        float(scale) * math.log2(math.e), batch, hq,
        HK=hk, GROUP=hq // hk, BS=block_size, D=d,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=max(next_power_of_2(batch), 16),
        IEEE_DOT=q.dtype == torch.float32, **fp8_args,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def warm_paged(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, device: torch.device | str) -> list[tuple[int, int, int, int]]:
    """Compiles every tile configuration of the paged kernel that `prefill_config` picks on
    this device, on a tiny step of the serving shape (heads, head_dim, block size, dtype: the
    compiled variant does not depend on the token count). A worker whose fresh prompts take
    the dense kernel meets the paged one only at a later chunk or a prefix-cache hit: without
    this, that request would wait for Triton to compile. Returns the configurations run."""
    device = torch.device(device)
    configs = ([config for _, config in _CUDA_CONFIGS.get(head_dim, ((None, _CUDA_FALLBACK),))]
               if device.type == "cuda" else [_INTERPRETER_CONFIG])
    k_cache = torch.zeros(2, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([block_size + 2], dtype=torch.int32, device=device)
    q = torch.zeros(2, num_heads, head_dim, dtype=dtype, device=device)
    for config in configs:
        prefill_attention_triton(q, k_cache, v_cache, tables, cu, seq_lens, head_dim ** -0.5, config=config)
    return configs


def dense_applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a step whose prefills all start at position 0 reads the keys and values of
    its own k/v (kernels.prefill_attention_dense) rather than the paged cache: on CUDA with
    the Triton kernels, a cache that is not FP8 (whose decode would read the quantized
    values). The process's prefill attention setting (`dispatch.configure`, from
    PDSERVE_PREFILL_ATTENTION at the edge) "paged" turns it off; "dense" also takes it off CUDA
    (the Triton interpreter, in tests)."""
    choice = settings().prefill_attention
    if choice == "paged" or k_cache.dtype != q.dtype or kernel_backend(q.device) != "triton":
        return False
    return q.is_cuda or choice == "dense"


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float,
                      fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                      max_q_len: int | None = None) -> torch.Tensor:
    """Causal varlen attention of q[T, Hq, D] over the paged cache; returns out[T, Hq, D].
    `fresh_kv` = (k, v)[T, Hkv, D], the rotated keys and values of the same rows, when every
    sequence starts at position 0 and `dense_applies`: they are read in place of the cache
    (`max_q_len`, the longest sequence's rows, picks the dense kernel's tiles)."""
    if fresh_kv is not None:
        return dense_prefill_attention_triton(q, fresh_kv[0], fresh_kv[1], cu_seqlens_q, scale,
                                              max_len=max_q_len)
    if kernel_backend(q.device) == "triton":
        return prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                         seq_lens, scale)
    return prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
