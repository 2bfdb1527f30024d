"""Block gather/scatter of several pools in one launch: the Triton kernel (interpreted on CPU)
against the torch reference, for fp32, bf16 and byte-sized rows."""

import pytest
import torch

from pdserve.kernels.kv_copy import (copy_blocks, copy_blocks_ref, gather_blocks, gather_blocks_ref, scatter_blocks,
                                     scatter_blocks_ref)
from pdserve.kernels.dispatch import force_backend


@pytest.mark.parametrize("dtype, row", [(torch.float32, 40), (torch.bfloat16, 48), (torch.uint8, 7)])
def test_gather_scatter_match_reference(needs_triton, dtype, row):
    gen = torch.Generator().manual_seed(3)
    pools = torch.randn(4, 9, row, generator=gen).to(dtype) if dtype != torch.uint8 else \
        torch.randint(0, 255, (4, 9, row), generator=gen, dtype=torch.uint8)
    index = torch.tensor([7, 0, 3, 8], dtype=torch.int64)
    with force_backend("triton"):
        staged = torch.empty(4, 4, row, dtype=dtype)
        gather_blocks(pools, index, staged)
    want = torch.empty_like(staged)
    gather_blocks_ref(pools, index, want)
    assert torch.equal(staged, want)
    assert torch.equal(staged[2, 1], pools[2, 0]) and torch.equal(staged[3, 0], pools[3, 7])

    target, ref = torch.zeros_like(pools), torch.zeros_like(pools)
    with force_backend("triton"):
        scatter_blocks(target, index, staged)
    scatter_blocks_ref(ref, index, staged)
    assert torch.equal(target, ref)
    untouched = [b for b in range(9) if b not in index.tolist()]
    assert not target[:, untouched].any()


def test_views_of_a_stacked_allocation():
    """Pools sliced out of [layers, 2, NB, ...] (what the KV transfer passes) on the torch path."""
    stacked = torch.randn(3, 2, 5, 4, 6)
    pools = stacked[1:3].reshape(4, 5, -1)
    staged = torch.empty(4, 2, 24)
    gather_blocks(pools, torch.tensor([4, 2]), staged)
    assert torch.equal(staged.view(2, 2, 2, 4, 6), stacked[1:3, :, [4, 2]])


def test_bad_shapes_are_refused():
    pools = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="does not match"):
        gather_blocks(pools, torch.tensor([1]), torch.zeros(2, 2, 8))
    with pytest.raises(ValueError, match="int64"):
        gather_blocks(pools, torch.tensor([1], dtype=torch.int32), torch.zeros(2, 1, 8))


@pytest.mark.parametrize("dtype, row", [(torch.float32, 40), (torch.bfloat16, 48), (torch.uint8, 7)])
def test_copy_between_pool_sets_matches_reference(needs_triton, dtype, row):
    """Pool set to pool set without staging (the pull path): different block counts per side."""
    gen = torch.Generator().manual_seed(5)
    src = torch.randn(3, 9, row, generator=gen).to(dtype) if dtype != torch.uint8 else \
        torch.randint(0, 255, (3, 9, row), generator=gen, dtype=torch.uint8)
    si, di = torch.tensor([8, 0, 4], dtype=torch.int64), torch.tensor([1, 5, 2], dtype=torch.int64)
    dst, ref = torch.zeros(3, 6, row, dtype=dtype), torch.zeros(3, 6, row, dtype=dtype)
    with force_backend("triton"):
        copy_blocks(src, si, dst, di)
    copy_blocks_ref(src, si, ref, di)
    assert torch.equal(dst, ref)
    assert torch.equal(dst[2, 1], src[2, 8]) and torch.equal(dst[0, 2], src[0, 4])
    assert not dst[:, [0, 3, 4]].any()


def test_copy_blocks_refuses_mismatches():
    with pytest.raises(ValueError, match="differ"):
        copy_blocks(torch.zeros(2, 4, 8), torch.tensor([1]), torch.zeros(2, 4, 6), torch.tensor([0]))
    with pytest.raises(ValueError, match="1 source blocks but 2"):
        copy_blocks(torch.zeros(2, 4, 8), torch.tensor([1]), torch.zeros(2, 4, 8), torch.tensor([0, 1]))
