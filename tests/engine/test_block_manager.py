import pytest

from pdserve.block_manager import BlockManager, BlockTable, NoFreeBlocksError, block_hash


def test_allocate_exact_ids_and_free_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = BlockTable(), BlockTable()
    assert bm.allocate(a, list(range(10))) == 0  # 10 tokens -> 3 blocks, nothing cached yet
    assert a.block_ids == [0, 1, 2]
    assert bm.allocate(b, [100, 101]) == 0
    assert b.block_ids == [3]
    assert bm.num_free_blocks == 4
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 1]
    bm.free(a)
    assert a.block_ids == []
    assert bm.num_free_blocks == 7
    # Unhashed freed blocks are handed out first, the table's first block first.
    c = BlockTable()
    bm.allocate(c, [7] * 12)
    assert c.block_ids == [0, 1, 2]


def test_prefix_cache_hit_shares_blocks_with_refcounts():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    a = BlockTable()
    bm.allocate(a, prompt)
    bm.mark_computed(a, prompt, 10)  # two full blocks computed -> hashed
    assert len(a.block_hashes) == 2
    assert a.block_hashes[0] == block_hash(None, [0, 1, 2, 3])
    assert a.block_hashes[1] == block_hash(a.block_hashes[0], [4, 5, 6, 7])
    b = BlockTable()
    cached = bm.allocate(b, list(range(8)) + [50, 51, 52])
    assert cached == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    assert b.block_ids[2] not in a.block_ids
    assert bm.num_prefix_hits == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_full_prompt_hit_keeps_last_block_private():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    a = BlockTable()
    bm.allocate(a, prompt)
    bm.mark_computed(a, prompt, 8)
    b = BlockTable()
    assert bm.allocate(b, prompt) == 4  # the last block is recomputed, never shared
    assert b.block_ids[0] == a.block_ids[0]
    assert b.block_ids[1] != a.block_ids[1]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_lru_eviction_order_of_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    tables = []
    for first in (10, 20):
        t = BlockTable()
        bm.allocate(t, [first, first + 1, first + 2, first + 3])
        bm.mark_computed(t, [first, first + 1, first + 2, first + 3], 4)
        tables.append(t)
    assert bm.num_cached_blocks == 4
    bm.free(tables[0])  # blocks 0,1 become evictable: tail first -> order 1, 0
    bm.free(tables[1])  # then 3, 2
    assert bm.num_free_blocks == 4
    t = BlockTable()
    bm.allocate(t, [99, 98, 97])
    assert t.block_ids == [1, 0]  # least recently freed cached blocks are evicted first
    assert bm.num_cached_blocks == 2
    # The prefix [20..23] survives; [10..13] was evicted.
    assert bm.longest_cached_prefix([20, 21, 22, 23]) == [2, 3]
    assert bm.longest_cached_prefix([10, 11, 12, 13]) == []
    bm.free(t)
    assert bm.num_free_blocks == 4


def test_hit_on_evictable_block_reclaims_it():
    bm = BlockManager(num_blocks=3, block_size=2)
    t = BlockTable()
    bm.allocate(t, [1, 2, 3])
    bm.mark_computed(t, [1, 2, 3], 3)
    bm.free(t)
    assert bm.num_free_blocks == 3
    u = BlockTable()
    assert bm.allocate(u, [1, 2, 5, 6, 7]) == 2
    assert u.block_ids[0] == 0
    assert bm.blocks[0].ref_count == 1
    assert bm.num_free_blocks == 0
    bm.free(u)


def test_can_allocate_counts_reclaimed_hits():
    bm = BlockManager(num_blocks=2, block_size=2)
    t = BlockTable()
    bm.allocate(t, [1, 2, 3])
    bm.mark_computed(t, [1, 2, 3], 3)
    bm.free(t)
    assert bm.can_allocate([1, 2, 3, 4])  # one hit (reclaimed) + one new = 2 blocks
    assert not bm.can_allocate([1, 2, 3, 4, 5])


def test_append_slots_and_exhaustion():
    bm = BlockManager(num_blocks=2, block_size=2)
    t = BlockTable()
    bm.allocate(t, [1])
    assert t.block_ids == [0]
    bm.append_slots(t, 2)
    assert t.block_ids == [0]
    bm.append_slots(t, 3)
    assert t.block_ids == [0, 1]
    assert not bm.can_append(t, 5)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(t, 5)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(BlockTable(), [1, 2, 3])
    bm.free(t)
    assert bm.num_free_blocks == 2


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    t = BlockTable()
    bm.allocate(t, [1, 2, 3])
    bm.mark_computed(t, [1, 2, 3], 3)
    assert bm.num_cached_blocks == 0
    u = BlockTable()
    assert bm.allocate(u, [1, 2, 3]) == 0
    bm.free(t)
    bm.free(u)


def test_double_free_is_an_invariant_error():
    bm = BlockManager(num_blocks=2, block_size=2)
    t = BlockTable()
    bm.allocate(t, [1])
    ids = list(t.block_ids)
    bm.free(t)
    t.block_ids.extend(ids)
    with pytest.raises(AssertionError):
        bm.free(t)
