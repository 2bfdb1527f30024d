"""Paged KV block bookkeeping: allocation, reference counts, hash-based prefix caching.

Pure Python (no torch, no I/O, no clock). A block holds `block_size` tokens of KV for every
layer. A full block whose KV has been computed gets a chain hash (its parent's hash and its
own tokens); a later request whose prompt starts with the same tokens reuses it. Blocks whose
reference count drops to zero stay cached, in LRU order, until an allocation evicts them.
Free blocks without a hash are handed out first, so cached blocks live as long as possible.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free; callers check first."""


def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chain hash of a full block; deterministic across processes (ints and tuples only)."""
    return hash((parent_hash if parent_hash is not None else -1, tuple(token_ids)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


@dataclass
class BlockTable:
    """The blocks of one request, and the hashes of its computed full blocks."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, in the order they are handed out (first = next).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id
        self.num_prefix_hits = 0  # blocks reused from the prefix cache, cumulative
        self.num_prefix_queries = 0  # full blocks looked up, cumulative

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free and evictable cached ones)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def longest_cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids caching the longest run of full blocks at the start of `token_ids`."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            h = block_hash(parent, token_ids[start:start + self.block_size])
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
            parent = h
        return hits

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        hits = self._usable_hits(token_ids)
        num_new = self.blocks_needed(len(token_ids)) - len(hits)
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return num_new <= self.num_free_blocks - reclaimed

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, table: BlockTable, token_ids: Sequence[int]) -> int:
        """Gives `table` blocks for all of `token_ids`, reusing cached prefix blocks.

        Returns the number of tokens whose KV is already cached. At least one token is always
        left to compute (the last block is never shared), so the request can produce logits.
        """
        if table.block_ids:
            raise ValueError("allocate() on a block table that already holds blocks")
        if not self.can_allocate(token_ids):
            raise NoFreeBlocksError(f"not enough free blocks for {len(token_ids)} tokens")
        hits = self._usable_hits(token_ids)
        self.num_prefix_queries += len(token_ids) // self.block_size
        self.num_prefix_hits += len(hits)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            table.block_ids.append(block_id)
            table.block_hashes.append(block.hash)  # type: ignore[arg-type]
        for _ in range(self.blocks_needed(len(token_ids)) - len(hits)):
            table.block_ids.append(self._take_free_block())
        return len(hits) * self.block_size

    def allocate_blocks(self, table: BlockTable, num_tokens: int) -> None:
        """Gives `table` fresh blocks for `num_tokens` tokens, with no prefix-cache lookup
        (KV arriving from another worker lands in them)."""
        if table.block_ids:
            raise ValueError("allocate_blocks() on a block table that already holds blocks")
        needed = self.blocks_needed(num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"not enough free blocks for {num_tokens} tokens")
        for _ in range(needed):
            table.block_ids.append(self._take_free_block())

    def can_append(self, table: BlockTable, num_tokens: int) -> bool:
        """Whether `table` can grow to hold `num_tokens` tokens."""
        return self.blocks_needed(num_tokens) - len(table.block_ids) <= self.num_free_blocks

    def append_slots(self, table: BlockTable, num_tokens: int) -> None:
        """Grows `table` so it holds `num_tokens` tokens."""
        missing = self.blocks_needed(num_tokens) - len(table.block_ids)
        if missing > self.num_free_blocks:
            raise NoFreeBlocksError(f"not enough free blocks to grow to {num_tokens} tokens")
        for _ in range(missing):
            table.block_ids.append(self._take_free_block())

    def mark_computed(self, table: BlockTable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Registers the hashes of the full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table.block_ids))
        for index in range(len(table.block_hashes), num_full):
            parent = table.block_hashes[index - 1] if index else None
            start = index * self.block_size
            h = block_hash(parent, token_ids[start:start + self.block_size])
            table.block_hashes.append(h)
            block = self.blocks[table.block_ids[index]]
            if h not in self._cached and block.hash is None:
                block.hash = h
                self._cached[h] = block.block_id

    def free(self, table: BlockTable) -> None:
        """Drops `table`'s references; its last blocks are evicted first."""
        for block_id in reversed(table.block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise AssertionError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)
        table.block_ids.clear()
        table.block_hashes.clear()

    def reset_prefix_cache(self) -> None:
        for h, block_id in list(self._cached.items()):
            if self.blocks[block_id].ref_count == 0:
                self.blocks[block_id].hash = None
                del self._cached[h]
                self._free.move_to_end(block_id, last=False)

    # ---- internals -----------------------------------------------------------------------
    def _usable_hits(self, token_ids: Sequence[int]) -> list[int]:
        hits = self.longest_cached_prefix(token_ids)
        if hits and len(hits) * self.block_size >= len(token_ids):
            hits = hits[:-1]  # keep one token to compute; never write into a shared block
        return hits

    def _take_free_block(self) -> int:
        if not self._free:
            raise NoFreeBlocksError("no free blocks")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the least recently used cached block
            del self._cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id
