"""The MoE MLP: routing against a hand computation, the shape checks, the align step exactly
(against its Python oracle and by its invariants), and the Triton path (interpreted on CPU)
against the torch reference, one expert at a time."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import fused_moe as moe
from pdserve.kernels.dispatch import force_backend
from pdserve.kernels.fused_moe import (MoEConfig, check_moe_shapes, fused_moe, fused_moe_ref, fused_moe_triton,
                                       moe_align, moe_align_ref, moe_align_size, moe_config, moe_route)

F32, BF16 = torch.float32, torch.bfloat16
HIDDEN, INTER = 32, 48  # I is no multiple of the default BLOCK_N, H none of the default BLOCK_K
TOL = {F32: dict(rtol=1e-5, atol=1e-5), BF16: dict(rtol=2e-2, atol=2e-2)}
SMALL_TILES = MoEConfig(16, 16, 16, group_m=2)  # several blocks an expert, grouped order, K loop without masks


@pytest.fixture
def bf16_as_compiled(monkeypatch):
    """Make Triton's interpreter do bfloat16 as the compiled kernel does. Its `InterpreterBuilder`
    multiplies bfloat16 `tl.dot` operands as their raw uint16 bits (`create_dot` widens only fp8), and
    casts float32 to bfloat16 by truncation where the GPU rounds to nearest even (`cvt.rn`). Widen the
    dot operands to float32 (exact) and round the casts to nearest even."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def widened_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def rounded_cast(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # finite inputs only
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    monkeypatch.setattr(builder, "create_dot", widened_dot)
    monkeypatch.setattr(builder, "cast_impl", rounded_cast)


def make_moe(num_tokens, num_experts, top_k, dtype, dropped=0, seed=0):
    """x, w13, w2 and a renormalized routing; `dropped` slots get id -1 (experts of another EP rank)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) / math.sqrt(HIDDEN)).to(dtype)
    w2 = (torch.randn(num_experts, HIDDEN, INTER, generator=g) / math.sqrt(INTER)).to(dtype)
    weights, ids = moe_route(torch.randn(num_tokens, num_experts, generator=g), top_k, renormalize=True)
    if dropped:
        flat = ids.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[:dropped]] = -1
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_triton_matches_reference(needs_triton, bf16_as_compiled, num_tokens, top_k, num_experts, dtype):
    x, w13, w2, weights, ids = make_moe(num_tokens, num_experts, top_k, dtype, seed=num_tokens * top_k)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (num_tokens, HIDDEN)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, weights, ids), **TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_tokens, top_k, num_experts, dropped", [
    (1, 2, 4, 1), (7, 2, 8, 5), (40, 2, 4, 30), (33, 1, 8, 10), (6, 2, 4, 12)])
def test_triton_ids_of_other_ranks_contribute_nothing(needs_triton, bf16_as_compiled, num_tokens, top_k,
                                                      num_experts, dropped, dtype):
    x, w13, w2, weights, ids = make_moe(num_tokens, num_experts, top_k, dtype, dropped=dropped, seed=dropped)
    assert (ids == -1).sum() == dropped
    got = fused_moe_triton(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, weights, ids), **TOL[dtype])
    if dropped == ids.numel():  # every slot elsewhere: exactly zero
        assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("config", [SMALL_TILES, MoEConfig(32, 32, 16, group_m=1), MoEConfig(16, 64, 64, group_m=8)],
                         ids=["16x16x16-g2", "32x32x16-g1", "16x64x64-g8"])
def test_triton_tiles(needs_triton, bf16_as_compiled, config, dtype):
    """Tokens over several row blocks of one expert, column tiles across I and H, the unmasked K loop."""
    x, w13, w2, weights, ids = make_moe(40, 4, 2, dtype, dropped=7, seed=3)
    got = fused_moe_triton(x, w13, w2, weights, ids, config=config)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, weights, ids), **TOL[dtype])


def test_triton_no_tokens(needs_triton):
    x, w13, w2, weights, ids = make_moe(0, 4, 2, F32)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    assert got.shape == (0, HIDDEN) and got.dtype == F32
    assert fused_moe_ref(x, w13, w2, weights, ids).shape == (0, HIDDEN)


def test_triton_strided_inputs(needs_triton):
    """x a column slice of a wider tensor, the routing transposed views: strides are honoured."""
    x, w13, w2, weights, ids = make_moe(9, 8, 2, F32, dropped=3, seed=5)
    wide = torch.randn(9, HIDDEN + 8)
    wide[:, 8:] = x
    weights_t, ids_t = weights.t().contiguous().t(), ids.t().contiguous().t()
    got = fused_moe_triton(wide[:, 8:], w13, w2, weights_t, ids_t)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, weights, ids), **TOL[F32])


def test_triton_refuses_mixed_dtypes(needs_triton):
    x, w13, w2, weights, ids = make_moe(3, 4, 2, F32)
    with pytest.raises(ValueError, match="w13 dtype"):
        fused_moe_triton(x, w13.bfloat16(), w2, weights, ids)


def test_dispatch(needs_triton):
    x, w13, w2, weights, ids = make_moe(5, 4, 2, F32, dropped=2, seed=9)
    with force_backend("triton"):
        got = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, fused_moe_triton(x, w13, w2, weights, ids), rtol=0, atol=0)
    with force_backend("torch"):
        assert torch.equal(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))


# --- the align step -------------------------------------------------------------------------


def check_align(ids, num_experts, block_m):
    """moe_align against its oracle, and the invariants the GEMMs rely on."""
    sorted_slots, block_experts, total = moe_align(ids, num_experts, block_m)
    num_slots = ids.numel()
    padded = moe_align_size(num_slots, num_experts, block_m)
    assert sorted_slots.shape == (padded,) and block_experts.shape == (padded // block_m,)
    assert sorted_slots.dtype == block_experts.dtype == total.dtype == torch.int32
    n = int(total)
    want_slots, want_experts = moe_align_ref(ids, num_experts, block_m)
    assert n == len(want_slots) <= padded and n % block_m == 0
    assert sorted_slots[:n].tolist() == want_slots
    assert block_experts.tolist() == want_experts + [-1] * (padded // block_m - len(want_experts))

    flat = ids.reshape(-1)
    here = (flat >= 0) & (flat < num_experts)
    slots = sorted_slots[:n]
    real = slots[slots < num_slots].long()
    assert torch.equal(torch.sort(real).values, torch.nonzero(here).view(-1))  # every slot of ours, once
    assert torch.all((slots == num_slots) | (slots < num_slots))  # the rest is padding
    for b, expert in enumerate(block_experts[:n // block_m].tolist()):
        block = slots[b * block_m:(b + 1) * block_m]
        block = block[block < num_slots].long()
        assert block.numel() > 0 and torch.all(flat[block] == expert)  # one expert a block, none empty
    return n


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m", [
    (1, 1, 4, 16), (1, 2, 8, 16), (5, 2, 4, 16), (40, 2, 4, 16), (40, 2, 8, 32), (17, 2, 5, 16), (64, 8, 16, 16)])
def test_align_exact(needs_triton, num_tokens, top_k, num_experts, block_m):
    _, ids = moe_route(torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_tokens)),
                       top_k, renormalize=False)
    check_align(ids, num_experts, block_m)


def test_align_with_ids_elsewhere_and_many_chunks(needs_triton, monkeypatch):
    """Ids of -1 (and out of range) get no position; a small tile splits the slots into many chunks,
    so that each chunk's placement starts from the counts of the chunks before it."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(-1, 6, (45, 3), generator=g)
    ids[0, 0], ids[3, 2] = 6, 99  # not an expert of this rank either
    assert check_align(ids, 6, 16) > 0
    monkeypatch.setattr(moe, "_ALIGN_TILE", 64)
    assert moe._align_tiles(ids.numel(), 6)[0] == 16
    check_align(ids, 6, 16)
    check_align(ids.to(torch.int32), 6, 32)


def test_align_known_case(needs_triton):
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]])  # slots 0..5
    sorted_slots, block_experts, total = moe_align(ids, 4, 16)
    assert int(total) == 32
    assert sorted_slots[:32].tolist() == [1, 4] + [6] * 14 + [0, 2, 5] + [6] * 13
    assert block_experts.tolist()[:2] == [0, 2] and set(block_experts.tolist()[2:]) == {-1}


def test_align_nothing_routed(needs_triton):
    sorted_slots, block_experts, total = moe_align(torch.full((3, 2), -1), 4, 16)
    assert int(total) == 0 and set(block_experts.tolist()) == {-1}
    sorted_slots, block_experts, total = moe_align(torch.empty(0, 2, dtype=torch.int64), 4, 16)
    assert int(total) == 0 and sorted_slots.numel() == block_experts.numel() == 0


@pytest.mark.parametrize("num_slots, num_experts, block_m, want", [
    (0, 8, 16, 0), (1, 8, 16, 16), (2, 8, 16, 32), (8, 128, 16, 128), (64, 8, 16, 192), (4096, 8, 128, 5120)])
def test_align_size_is_the_worst_case(num_slots, num_experts, block_m, want):
    assert moe_align_size(num_slots, num_experts, block_m) == want


# --- routing, shapes, tiles ------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_by_hand(renormalize):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, math.log(4.0), math.log(2.0)]])
    weights, ids = moe_route(logits, 2, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.tolist() == [[1, 2], [2, 3]]
    z0 = math.exp(1) + math.exp(3) + math.exp(2) + 1
    want = [[math.exp(3) / z0, math.exp(2) / z0], [4 / 8, 2 / 8]]  # row 1: exp is (1, 1, 4, 2)
    if renormalize:
        want = [[w / sum(row) for w in row] for row in want]
    torch.testing.assert_close(weights, torch.tensor(want), rtol=1e-6, atol=1e-7)


def test_route_bf16_logits_softmax_in_float32():
    logits = torch.randn(3, 8).bfloat16()
    weights, ids = moe_route(logits, 8, renormalize=False)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(3))
    assert torch.equal(torch.sort(ids, dim=-1).values, torch.arange(8).expand(3, 8))


@pytest.mark.parametrize("top_k", [0, 5])
def test_route_refuses_top_k(top_k):
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_route(torch.randn(2, 4), top_k, True)
    with pytest.raises(ValueError, match="router_logits"):
        moe_route(torch.randn(4), 1, True)


def _shapes(t=3, h=8, i=6, e=4, k=2, x_dtype=F32):
    return (torch.randn(t, h).to(x_dtype), torch.randn(e, 2 * i, h), torch.randn(e, h, i), torch.rand(t, k),
            torch.zeros(t, k, dtype=torch.int64))


@pytest.mark.parametrize("change, match", [
    (lambda a: (a[0].double(), *a[1:]), "x must be a float"),
    (lambda a: (a[0][0], *a[1:]), "x must be a float"),
    (lambda a: (a[0], a[1][:, :, :7], *a[2:]), r"w13 must be \[E, 2I, 8\]"),
    (lambda a: (a[0], a[1][:, :11], *a[2:]), r"w13 must be \[E, 2I, 8\]"),
    (lambda a: (a[0], a[1], a[2][:, :, :5], *a[3:]), r"w2 must be \[4, 8, 6\]"),
    (lambda a: (a[0], a[1], a[2][:3], *a[3:]), r"w2 must be \[4, 8, 6\]"),
    (lambda a: (*a[:3], a[3][:, :1], a[4]), "topk_weights and topk_ids must both be"),
    (lambda a: (*a[:4], a[4][:2]), "topk_weights and topk_ids must both be"),
    (lambda a: (*a[:3], a[3][:2], a[4][:2]), r"must both be \[3, K\]"),
], ids=["x-dtype", "x-1d", "w13-hidden", "w13-odd", "w2-inter", "w2-experts", "weights-k", "ids-t", "both-t"])
def test_shape_errors(change, match):
    args = _shapes()
    check_moe_shapes(*args)
    with pytest.raises(ValueError, match=match):
        check_moe_shapes(*change(args))
    with pytest.raises(ValueError, match=match):
        fused_moe_ref(*change(args))


def test_config_heuristic_and_checks():
    decode, prefill = moe_config(8, 128), moe_config(2048 * 2, 8)
    assert decode.block_m == 16 and prefill.block_m > decode.block_m
    sizes = [moe_config(t * 2, 8).block_m for t in (1, 16, 64, 256, 2048)]
    assert sizes == sorted(sizes)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        MoEConfig(16, 48, 64)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        MoEConfig(8, 64, 64)
    with pytest.raises(ValueError, match="group_m"):
        MoEConfig(16, 64, 64, group_m=0)
