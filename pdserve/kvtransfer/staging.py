"""Gather a layer's blocks into one contiguous staging buffer, and scatter it back.

A staging buffer holds K then V for ``n`` blocks: ``[2, n, block_size, num_kv_heads,
head_dim]`` in the cache dtype, on the cache device. On the wire it is the same memory
seen as ``n * 2 * block_bytes`` uint8.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pdserve.kernels.kv_copy import copy_blocks, gather_blocks, scatter_blocks
from pdserve.kvtransfer.layout import MAX_BLOCKS_PER_MESSAGE, KVLayout

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


def gather_layer(kv_caches: KVCaches, layer: int, src_index: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy blocks ``src_index`` of ``layer`` into ``[2, n, *block_shape]``: ``out`` (flat
    uint8 of the right size, reused memory) or a new tensor. Pools made of several ranks'
    heads (``pdserve.kvtransfer.shards.HeadShards``) gather their pieces."""
    if getattr(kv_caches, "whole", True) is False:
        return kv_caches.gather_layer(layer, src_index, out)
    k_pool, v_pool = (_indexable(p) for p in kv_caches[layer])
    shape = (2, src_index.numel(), *k_pool.shape[1:])
    if out is None:
        staged = torch.empty(shape, dtype=k_pool.dtype, device=k_pool.device)
    else:
        staged = out.view(k_pool.dtype).view(shape)
    torch.index_select(k_pool, 0, src_index, out=staged[0])
    torch.index_select(v_pool, 0, src_index, out=staged[1])
    return staged


class HostBuffers:
    """Reused host staging buffers, by size. A fresh host allocation of megabytes is paged in
    on first touch (tens of ms per transfer on a small VM); CUDA memory needs no such pool,
    the caching allocator is one."""

    def __init__(self, max_per_size: int = 64):
        self._free: dict[int, list[torch.Tensor]] = {}
        self._max = max_per_size

    def take(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        return free.pop() if free else torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        free = self._free.setdefault(buffer.numel(), [])
        if len(free) < self._max:
            free.append(buffer)


def stacked_pools(kv_caches: KVCaches) -> torch.Tensor | None:
    """``[num_layers, 2, num_blocks, *block_shape]`` over the pools when they are views of
    one allocation in that order (the engine allocates them so), else None. Then a message of
    several layers is gathered or scattered in one op instead of two per layer. None for pools
    made of several ranks' heads (``pdserve.kvtransfer.shards.HeadShards``)."""
    if getattr(kv_caches, "whole", True) is False:
        return None
    k0 = kv_caches[0][0]
    numel = k0.numel()
    step = numel * k0.element_size()
    try:
        base = k0.untyped_storage().data_ptr()
    except RuntimeError:
        return None
    for layer, (k, v) in enumerate(kv_caches):
        for which, pool in enumerate((k, v)):
            if (pool.untyped_storage().data_ptr() != base or not pool.is_contiguous()
                    or pool.data_ptr() != k0.data_ptr() + (2 * layer + which) * step):
                return None
    return torch.as_strided(k0, (len(kv_caches), 2, *k0.shape), (2 * numel, numel, *k0.stride()),
                            k0.storage_offset())


def gather_layers(stacked: torch.Tensor, first: int, count: int, src_index: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """Blocks ``src_index`` of layers ``[first, first + count)`` into ``out`` (flat uint8 of
    the right size), seen as ``[count, 2, n, *block_shape]``; one launch (kernels.kv_copy)."""
    n = src_index.numel()
    staged = out.view(stacked.dtype).view(count, 2, n, *stacked.shape[3:])
    pools = stacked[first:first + count].reshape(2 * count, stacked.shape[2], -1)
    gather_blocks(pools, src_index, staged.view(2 * count, n, -1))
    return staged


def scatter_layers(stacked: torch.Tensor, first: int, dst_index: torch.Tensor, staged: torch.Tensor) -> None:
    """Write ``staged`` ``[count, 2, n, *block_shape]`` into blocks ``dst_index`` of layers
    ``[first, first + count)``; one launch (kernels.kv_copy)."""
    count, n = staged.shape[0], staged.shape[2]
    pools = stacked[first:first + count].reshape(2 * count, stacked.shape[2], -1)
    scatter_blocks(pools, dst_index, staged.reshape(2 * count, n, -1))


def copy_layers(src_stacked: torch.Tensor, dst_stacked: torch.Tensor, first: int, count: int,
                src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
    """Blocks ``src_index`` of layers ``[first, first + count)`` of ``src_stacked`` into blocks
    ``dst_index`` of the same layers of ``dst_stacked``, no staging; one launch on dst's device."""
    src = src_stacked[first:first + count].reshape(2 * count, src_stacked.shape[2], -1)
    dst = dst_stacked[first:first + count].reshape(2 * count, dst_stacked.shape[2], -1)
    copy_blocks(src, src_index, dst, dst_index)


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


def ready_prefix(pending, event_of) -> list:
    """Waits for the oldest item of ``pending`` (a deque, oldest first; ``event_of(item)`` is
    its CUDA event) and pops it with every item behind it whose event has already completed.

    The work behind the events runs in order on one stream, so the items come ready in
    order: the oldest is handed on as soon as its own work ends. Waiting for the newest
    instead stalls every earlier item until the whole queue is computed, and the engine
    queues a forward's layers well before the GPU runs them."""
    event_of(pending[0]).synchronize()  # releases the GIL
    out = [pending.popleft()]
    while pending and event_of(pending[0]).query():
        out.append(pending.popleft())
    return out
