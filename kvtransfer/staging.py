"""Gather a layer's blocks into one contiguous staging buffer, and scatter it back.

A staging buffer holds K then V for ``n`` blocks: ``[2, n, block_size, num_kv_heads,
head_dim]`` in the cache dtype, on the cache device. On the wire it is the same memory
seen as ``n * 2 * block_bytes`` uint8.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvtransfer.layout import MAX_BLOCKS_PER_MESSAGE, KVLayout

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def block_index(block_ids: Sequence[int], num_blocks: int | None, what: str, device: torch.device) -> torch.Tensor:
    """Validate ``block_ids`` (non-empty, distinct, in ``[0, num_blocks)``) and return an int64 index tensor."""
    ids = [int(b) for b in block_ids]
    if not ids:
        raise ValueError(f"{what} is empty")
    if len(ids) > MAX_BLOCKS_PER_MESSAGE:
        raise ValueError(f"{what} has {len(ids)} blocks, at most {MAX_BLOCKS_PER_MESSAGE} per message")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} has duplicate block ids")
    upper = num_blocks if num_blocks is not None else 2**31
    bad = [b for b in ids if b < 0 or b >= upper]
    if bad:
        raise ValueError(f"{what} has block ids out of range [0, {upper}): {bad[:8]}")
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _indexable(pool: torch.Tensor) -> torch.Tensor:
    """FP8 pools as uint8 (same bytes): index_select/index_copy_ have no float8 kernels."""
    return pool.view(torch.uint8) if pool.element_size() == 1 else pool


def gather_layer(kv_caches: KVCaches, layer: int, src_index: torch.Tensor) -> torch.Tensor:
    """Copy blocks ``src_index`` of ``layer`` into a new ``[2, n, *block_shape]`` tensor."""
    k_pool, v_pool = (_indexable(p) for p in kv_caches[layer])
    staged = torch.empty((2, src_index.numel(), *k_pool.shape[1:]), dtype=k_pool.dtype, device=k_pool.device)
    torch.index_select(k_pool, 0, src_index, out=staged[0])
    torch.index_select(v_pool, 0, src_index, out=staged[1])
    return staged


def scatter_layer(kv_caches: KVCaches, layer: int, dst_index: torch.Tensor, staged: torch.Tensor) -> None:
    """Write ``staged`` ``[2, n, *block_shape]`` into blocks ``dst_index`` of ``layer``."""
    k_pool, v_pool = (_indexable(p) for p in kv_caches[layer])
    staged = _indexable(staged)
    k_pool.index_copy_(0, dst_index, staged[0])
    v_pool.index_copy_(0, dst_index, staged[1])


def as_bytes(staged: torch.Tensor) -> torch.Tensor:
    """The staging tensor seen as flat uint8 (same memory)."""
    return staged.reshape(-1).view(torch.uint8)


def from_bytes(raw: torch.Tensor, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """Flat uint8 ``raw`` seen as ``[2, num_blocks, *block_shape]`` of the layout dtype (same memory)."""
    return raw.view(layout.torch_dtype).view(2, num_blocks, *layout.block_shape)


def wire_buffer(raw: torch.Tensor):
    """An object ucxx can send from / receive into: the CUDA tensor itself
    (``__cuda_array_interface__``) or, on CPU, a numpy view of the same memory."""
    if raw.dtype != torch.uint8:
        raise TypeError("wire buffers are uint8")
    return raw if raw.is_cuda else raw.numpy()
