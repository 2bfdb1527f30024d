"""Causal attention of fresh prompts over their own contiguous K/V (no cached prefix).

A prefill chunk that starts at position 0 has all its keys in the step's own k/v tensors,
freshly computed (and rotated) by the QKV projection: reading them there, row after row,
spares the paged kernel's block-table lookups and lets Hopper-class GPUs fetch whole tiles
with TMA (`triton.tools.tensor_descriptor`). `pdserve.kernels.prefill_attention` takes this path
for a step whose prefill sequences all start at position 0 and whose cache is not FP8.

Sequence b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 of q[T, Hq, D] and of
k, v[T, Hkv, D]; row i of it sits at position i and sees keys 0..i of its own sequence.
GQA: query head h reads kv head h // (Hq / Hkv).
"""

from __future__ import annotations

import math

import torch

from pdserve.kernels._jit import TritonKernels, check_head_dim, check_tensor, next_power_of_2

tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _query_tile(cu_seqlens_ptr, B, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """This program's query tile, in the grid layout of both prefill kernels: sequence b owns
    the tiles from cu_seqlens[b] // BLOCK_M + b on, which always leaves room for
    cdiv(q_len_b, BLOCK_M) of them, so the grid (T // BLOCK_M + B) needs no host sync. Tiles run
    last first: under the causal mask later tiles see more keys, and starting the longest
    first balances the grid's tail. Returns (seq, q_begin, q_len, m_start); the tile is empty
    when m_start >= q_len."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    starts = tl.load(cu_seqlens_ptr + offs_b, mask=offs_b < B, other=0)
    first_tile = starts // BLOCK_M + offs_b
    seq = tl.sum(((first_tile <= tile) & (offs_b < B)).to(tl.int32), axis=0) - 1
    q_begin = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_begin
    m_start = (tile - (q_begin // BLOCK_M + seq)) * BLOCK_M
    return seq, q_begin, q_len, m_start


def _softmax_update(s, visible, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr):
    """The online-softmax step of both prefill kernels, log2 domain: raw scores `s` of one key
    tile (scaled here by qk_scale; `visible` masks them when MASKED) update the running max
    `m_i` and sum `l_i`, and rescale `acc`. Returns (m_new, l_i, acc, p), p the tile's
    unnormalized probabilities."""
    if MASKED:
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows of the tile past q_len may see no key yet; keep their arithmetic finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
    else:
        # Every key of the tile is visible to every row: no mask, scale folded into one FMA.
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        m_safe = m_new
        p = tl.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None], p


def _kv_tile(src, kv_begin, n_start, kv_col, stride_t, offs_n, offs_d, q_len,
             MASKED: tl.constexpr, TMA: tl.constexpr):
    """Rows kv_begin + n_start ... of one KV head (columns kv_col ...) of K or V: a TMA tile,
    or a pointer load with the rows past the sequence's end masked to 0."""
    if TMA:
        tile = src.load([kv_begin + n_start, kv_col])
    else:
        at = src + (kv_begin + offs_n).to(tl.int64)[:, None] * stride_t + kv_col + offs_d[None, :]
        if MASKED:
            tile = tl.load(at, mask=(offs_n < q_len)[:, None], other=0.0)
        else:
            tile = tl.load(at)
    return tile


def _dense_tile_update(q, k_src, v_src, kv_begin, kv_col, stride_kt, stride_vt, offs_d,
                       n_start, m_i, l_i, acc, offs_m, q_len, qk_scale,
                       BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
                       IEEE_DOT: tl.constexpr):
    """One BLOCK_N tile of keys: online-softmax update of (m_i, l_i, acc), log2 domain.
    Rows past the sequence's end (TMA reads the next sequence's, or zeros past T) are
    masked out of the scores, so they only ever get probability 0."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    k = _kv_tile(k_src, kv_begin, n_start, kv_col, stride_kt, offs_n, offs_d, q_len, MASKED, TMA)
    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n < q_len)[None, :]
    m_new, l_i, acc, p = _softmax_update(s, visible, m_i, l_i, acc, qk_scale, MASKED)
    v = _kv_tile(v_src, kv_begin, n_start, kv_col, stride_vt, offs_n, offs_d, q_len, MASKED, TMA)
    if IEEE_DOT:
        acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


def _dense_prefill_kernel(
    q_src,  # [T, HQ, D] (strides stride_qt, stride_qh, 1); TMA: a descriptor over [T, HQ * D]
    k_src,  # [T, HK, D] (strides stride_kt, D, 1); TMA: a descriptor over [T, HK * D]
    v_src,  # [T, HK, D] (strides stride_vt, D, 1); TMA: a descriptor over [T, HK * D]
    cu_seqlens_ptr,  # [B + 1] int32
    out_ptr,  # [T, HQ, D] contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_vt,
    qk_scale,  # softmax scale * log2(e)
    B,
    HQ,
    GROUP: tl.constexpr,  # HQ // HK
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,  # next_power_of_2(B)
    TMA: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    seq, q_begin, q_len, m_start = _query_tile(cu_seqlens_ptr, B, BLOCK_M, BLOCK_B)
    head = tl.program_id(1)
    if m_start < q_len:
        kv_col = (head // GROUP) * D
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        m_mask = offs_m < q_len
        rows = (q_begin + offs_m).to(tl.int64)
        if TMA:
            q = q_src.load([q_begin + m_start, head * D])
        else:
            q = tl.load(q_src + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                        mask=m_mask[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        # Keys before the tile's first row are visible to all its rows: whole BLOCK_N tiles
        # of them need no mask. The rest, up to the tile's last row, do.
        kv_end = tl.minimum(m_start + BLOCK_M, q_len)
        full_end = ((m_start + 1) // BLOCK_N) * BLOCK_N
        for n_start in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _dense_tile_update(
                q, k_src, v_src, q_begin, kv_col, stride_kt, stride_vt, offs_d, n_start,
                m_i, l_i, acc, offs_m, q_len, qk_scale, BLOCK_N, False, TMA, IEEE_DOT)
        for n_start in range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _dense_tile_update(
                q, k_src, v_src, q_begin, kv_col, stride_kt, stride_vt, offs_d, n_start,
                m_i, l_i, acc, offs_m, q_len, qk_scale, BLOCK_N, True, TMA, IEEE_DOT)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(out_ptr + rows[:, None] * (HQ * D) + head * D + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


_TRITON = TritonKernels(globals(), "_query_tile", "_softmax_update", "_kv_tile", "_dense_tile_update",
                        "_dense_prefill_kernel",
                        do_not_specialize={"_dense_prefill_kernel": ("B",)})


def _check_inputs(q, k, v, cu_seqlens) -> None:
    check_tensor("q", q, 3, _FLOAT_DTYPES)
    check_tensor("k", k, 3, (q.dtype,))
    check_tensor("v", v, 3, (q.dtype,))
    check_tensor("cu_seqlens", cu_seqlens, 1, (torch.int32,), contiguous=True)
    t, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({k.shape[1]})")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError(f"{name} must have contiguous heads (strides (*, {d}, 1)), got {x.stride()}")


def dense_prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    _check_inputs(q, k, v, cu_seqlens)
    group = q.shape[1] // k.shape[1]
    out = torch.empty((q.shape[0], q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        if cu[b + 1] == cu[b]:
            continue
        qb, kb, vb = (x[cu[b]:cu[b + 1]].transpose(0, 1) for x in (q, k, v))
        if group > 1:
            kb, vb = kb.repeat_interleave(group, dim=0), vb.repeat_interleave(group, dim=0)
        o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        out[cu[b]:cu[b + 1]] = o.transpose(0, 1)
    return out


# (BLOCK_M, BLOCK_N, num_warps, num_stages) on CUDA by the longest sequence's length, chosen by
# benchmarks/bench_kernels.py --paths --sweep (docs/results.md, issue 26: "Fresh prompts attend over
# their own K/V").
_CUDA_CONFIGS = ((4096, (64, 64, 4, 3)), (None, (128, 128, 8, 3)))
_CUDA_CONFIG_FP32 = (64, 32, 4, 2)
_INTERPRETER_CONFIG = (16, 16, 4, 1)


def dense_config(is_cuda: bool, dtype: torch.dtype, max_len: int) -> tuple[int, int, int, int]:
    """The tile configuration for sequences of up to `max_len` tokens."""
    if not is_cuda:
        return _INTERPRETER_CONFIG
    if dtype == torch.float32:
        return _CUDA_CONFIG_FP32
    for limit, config in _CUDA_CONFIGS:
        if limit is None or max_len <= limit:
            return config
    return _CUDA_CONFIGS[-1][1]


def _use_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """TMA descriptors need sm90+, 16-byte aligned bases and row strides."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    size = q.element_size()
    return all(x.data_ptr() % 16 == 0 and (x.stride(0) * size) % 16 == 0 for x in (q, k, v))


def dense_prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   cu_seqlens: torch.Tensor, scale: float, max_len: int | None = None,
                                   config: tuple[int, int, int, int] | None = None,
                                   tma: bool | None = None) -> torch.Tensor:
    """`max_len`: the longest sequence (picks the tiles; default T). `config` = (BLOCK_M,
    BLOCK_N, num_warps, num_stages) overrides that choice; `tma` forces the TMA descriptors
    on or off (default: on where the GPU and strides allow)."""
    _check_inputs(q, k, v, cu_seqlens)
    t, hq, d = q.shape
    hk = k.shape[1]
    check_head_dim(d)
    batch = cu_seqlens.shape[0] - 1
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0 or batch <= 0:
        return out
    if config is None:
        config = dense_config(q.is_cuda, q.dtype, t if max_len is None else max_len)
    block_m, block_n, num_warps, num_stages = config
    use_tma = _use_tma(q, k, v) if tma is None else tma
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        q_src = TensorDescriptor(q, [t, hq * d], [q.stride(0), 1], [block_m, d])
        k_src = TensorDescriptor(k, [t, hk * d], [k.stride(0), 1], [block_n, d])
        v_src = TensorDescriptor(v, [t, hk * d], [v.stride(0), 1], [block_n, d])
    else:
        q_src, k_src, v_src = q, k, v
    grid = (t // block_m + batch, hq)
    _TRITON.get("_dense_prefill_kernel")[grid](
        q_src, k_src, v_src, cu_seqlens, out,
        q.stride(0), q.stride(1), k.stride(0), v.stride(0),
        float(scale) * math.log2(math.e), batch, hq,
        GROUP=hq // hk, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_B=max(next_power_of_2(batch), 16), TMA=use_tma,
        IEEE_DOT=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    return out
