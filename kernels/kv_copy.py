"""Gather and scatter whole KV blocks of several pools in one launch (the KV transfer's staging).

    pools [P, NB, R]   P pools (layers x K/V) of NB blocks, a block being R contiguous words
    index [n]          block ids (int64, on the pools' device)
    staged [P, n, R]   gather: staged[p, j] = pools[p, index[j]]; scatter: the reverse

Blocks are copied as raw words whatever the cache dtype (bf16, fp32, FP8 with its scale rows):
the pools are viewed as int32 when a block's bytes allow, else as uint8. On CUDA this is one
Triton launch at close to copy bandwidth; torch's index_select / index_copy_ along the block
dim of a [P, NB, R] view run several times slower there. The torch reference is the CPU path.
"""

from __future__ import annotations

import torch

from kernels._jit import TritonKernels, cdiv
from kernels.dispatch import kernel_backend

tl = None  # bound to triton.language on the first launch (kernels._jit)

_BLOCK = 1024  # words per program


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


_TRITON = TritonKernels(globals(), "_copy_blocks_kernel", do_not_specialize={"_copy_blocks_kernel": ("n",)})


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
