"""Gather and scatter whole KV blocks of several pools in one launch (the KV transfer's staging).

    pools [P, NB, R]   P pools (layers x K/V) of NB blocks, a block being R contiguous words
    index [n]          block ids (int64, on the pools' device)
    staged [P, n, R]   gather: staged[p, j] = pools[p, index[j]]; scatter: the reverse

``copy_blocks`` moves blocks between two pool sets without a staging buffer: dst[p, di[j]] =
src[p, si[j]] (the KV transfer's pull path, where ``src`` is a peer GPU's pools mapped over
CUDA IPC and the reads go over NVLink).

Blocks are copied as raw words whatever the cache dtype (bf16, fp32, FP8 with its scale rows):
the pools are viewed as int32 when a block's bytes allow, else as uint8. On CUDA this is one
Triton launch at close to copy bandwidth; torch's index_select / index_copy_ along the block
dim of a [P, NB, R] view run several times slower there. The torch reference is the CPU path.
"""

from __future__ import annotations

import contextlib

import torch

from pdserve.kernels._jit import TritonKernels, cdiv
from pdserve.kernels.dispatch import kernel_backend

tl = None  # bound to triton.language on the first launch (kernels._jit)

_BLOCK = 1024  # words per program
# pool-to-pool copy: 16 KiB per program, 8 warps (a sweep of the tiling found none better over NVLink:
# docs/results.md, "Figures behind the code's choices")
_PULL_BLOCK, _PULL_WARPS = 4096, 8


def _copy_blocks_kernel(
    pools,  # [P, NB, R] words
    staged,  # [P, n, R] words
    index,  # [n] int64
    n,
    pool_stride,  # words between pools
    R,
    GATHER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # p * n + j
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < R
    pool = row // n
    block = tl.load(index + row % n)
    pooled = pools + pool * pool_stride + block * R + cols
    flat = staged + row * R + cols
    if GATHER:
        tl.store(flat, tl.load(pooled, mask=mask), mask=mask)
    else:
        tl.store(pooled, tl.load(flat, mask=mask), mask=mask)


def _copy_pool_blocks_kernel(
    src,  # [P, NBs, R] words
    dst,  # [P, NBd, R] words
    src_index,  # [n] int64
    dst_index,  # [n] int64
    n,
    src_stride,  # words between src pools
    dst_stride,  # words between dst pools
    R,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # p * n + j
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < R
    pool = row // n
    s = tl.load(src_index + row % n)
    d = tl.load(dst_index + row % n)
    tl.store(dst + pool * dst_stride + d * R + cols, tl.load(src + pool * src_stride + s * R + cols, mask=mask),
             mask=mask)


_TRITON = TritonKernels(globals(), "_copy_blocks_kernel", "_copy_pool_blocks_kernel",
                        do_not_specialize={"_copy_blocks_kernel": ("n",), "_copy_pool_blocks_kernel": ("n",)})


def _words(t: torch.Tensor) -> torch.Tensor:
    """The last dim's bytes as int32 words when they divide by 4, else as uint8."""
    raw = t.view(torch.uint8)
    return raw.view(torch.int32) if raw.shape[-1] % 4 == 0 else raw


def _check(pools: torch.Tensor, index: torch.Tensor, staged: torch.Tensor) -> None:
    if pools.dim() != 3 or staged.dim() != 3:
        raise ValueError(f"pools and staged must be [P, NB, R] and [P, n, R], got {tuple(pools.shape)} "
                         f"and {tuple(staged.shape)}")
    if index.dim() != 1 or index.dtype != torch.int64 or index.device != pools.device:
        raise ValueError("index must be a 1-D int64 tensor on the pools' device")
    if (staged.shape[0], staged.shape[1], staged.shape[2]) != (pools.shape[0], index.numel(), pools.shape[2]):
        raise ValueError(f"staged {tuple(staged.shape)} does not match pools {tuple(pools.shape)} "
                         f"and {index.numel()} blocks")
    if staged.dtype != pools.dtype or staged.device != pools.device or not staged.is_contiguous():
        raise ValueError("staged must be contiguous, with the pools' dtype and device")
    if pools.stride(2) != 1 or pools.stride(1) != pools.shape[2]:
        raise ValueError("each pool must be contiguous")


def gather_blocks_ref(pools: torch.Tensor, index: torch.Tensor, staged: torch.Tensor) -> None:
    torch.index_select(pools, 1, index, out=staged)


def scatter_blocks_ref(pools: torch.Tensor, index: torch.Tensor, staged: torch.Tensor) -> None:
    pools.index_copy_(1, index, staged)


def _copy(pools: torch.Tensor, index: torch.Tensor, staged: torch.Tensor, gather: bool) -> None:
    _check(pools, index, staged)
    words_pools, words_staged = _words(pools), _words(staged)
    if kernel_backend(pools.device) != "triton":
        (gather_blocks_ref if gather else scatter_blocks_ref)(words_pools, index, words_staged)
        return
    rows, width = staged.shape[0] * staged.shape[1], words_pools.shape[2]
    if rows == 0:
        return
    kernel = _TRITON.get("_copy_blocks_kernel")
    kernel[(rows, cdiv(width, _BLOCK))](words_pools, words_staged, index, index.numel(), words_pools.stride(0),
                                        width, GATHER=gather, BLOCK=_BLOCK)


def gather_blocks(pools: torch.Tensor, index: torch.Tensor, staged: torch.Tensor) -> None:
    """staged[p, j] = pools[p, index[j]] for every pool p (pools [P, NB, R], staged [P, n, R])."""
    _copy(pools, index, staged, gather=True)


def scatter_blocks(pools: torch.Tensor, index: torch.Tensor, staged: torch.Tensor) -> None:
    """pools[p, index[j]] = staged[p, j] for every pool p (index ids distinct)."""
    _copy(pools, index, staged, gather=False)


def copy_blocks_ref(src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor) -> None:
    dst.index_copy_(1, dst_index, torch.index_select(src, 1, src_index))


def copy_blocks(src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor) -> None:
    """dst[p, dst_index[j]] = src[p, src_index[j]] for every pool p (src [P, NBs, R], dst [P, NBd, R]),
    one launch on the indices' device: dst's (reads from a peer: a pull) or src's (writes to a
    peer: a push). The other side may be a peer GPU's memory (CUDA IPC or peer access)."""
    for name, pools in (("src", src), ("dst", dst)):
        if pools.dim() != 3 or pools.stride(2) != 1 or pools.stride(1) != pools.shape[2]:
            raise ValueError(f"{name} must be [P, NB, R] with contiguous pools, got {tuple(pools.shape)}")
    if src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2] or src.dtype != dst.dtype:
        raise ValueError(f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} differ "
                         "in pools, block size or dtype")
    for name, index in (("src_index", src_index), ("dst_index", dst_index)):
        if index.dim() != 1 or index.dtype != torch.int64 or index.device != src_index.device \
                or index.device not in (src.device, dst.device):
            raise ValueError(f"{name} must be a 1-D int64 tensor, both indices on src's or dst's device")
    if src_index.numel() != dst_index.numel():
        raise ValueError(f"{src_index.numel()} source blocks but {dst_index.numel()} destination blocks")
    words_src, words_dst = _words(src), _words(dst)
    if kernel_backend(dst.device) != "triton":
        copy_blocks_ref(words_src, src_index, words_dst, dst_index)
        return
    rows, width = dst.shape[0] * dst_index.numel(), words_dst.shape[2]
    if rows == 0:
        return
    kernel = _TRITON.get("_copy_pool_blocks_kernel")
    launching = torch.cuda.device(src_index.device) if src_index.is_cuda else contextlib.nullcontext()
    with launching:  # the launching GPU: dst's (a pull) or src's (a push)
        kernel[(rows, cdiv(width, _PULL_BLOCK))](words_src, words_dst, src_index, dst_index, dst_index.numel(),
                                                 words_src.stride(0), words_dst.stride(0), width,
                                                 BLOCK=_PULL_BLOCK, num_warps=_PULL_WARPS)
