"""Mixture-of-experts MLP: each token goes to its top-k experts, whose SwiGLU outputs are summed
with the routing weights.

Shapes (HF (out_features, in_features) for every weight):

    x             [T, H]        hidden states, float32 / float16 / bfloat16
    w13           [E, 2I, H]    per expert, the gate rows (0..I-1) then the up rows (I..2I-1)
    w2            [E, H, I]     per expert, the down projection
    topk_weights  [T, K]        float32 routing weights (renormalized or not, as the family says)
    topk_ids      [T, K]        int64 expert ids in [0, E)

Under tensor parallelism each rank holds every expert's slice of the intermediate dimension
(I / tp rows of w13's gate and up halves, I / tp columns of w2); its output is a partial sum that
the caller all-reduces, as for the dense MLP. Under expert parallelism a rank holds whole experts,
and ids of experts it does not hold are given as -1 (their contribution is zero).

Rounding follows HF's sparse MoE blocks: each expert's MLP runs in x's dtype (silu(gate) rounded to
that dtype before the multiply, as `silu_and_mul`), its output is multiplied by the routing weight
cast to x's dtype, and the top-k contributions are summed in x's dtype.

The Triton path, four steps, none of which reads a device value on the host (CUDA-graph safe):
1. align: the T*K token slots grouped by expert, each expert's run padded to a multiple of BLOCK_M
   (per-chunk counts, then placement; one kernel when the slots fit one chunk); buffers are sized
   for the worst case;
2. gate/up: one grouped GEMM over the blocks, each block one expert's, SiLU * up in its epilogue;
3. down: the second grouped GEMM, the routing weight applied in its epilogue;
4. top-k sum: the K rows of each token added in slot order (ids < 0 skipped) into [T, H].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels._jit import TritonKernels, cdiv, check_tensor, next_power_of_2
from pdserve.kernels.activation import silu_and_mul_ref
from pdserve.kernels.dispatch import kernel_backend

tl = None  # bound to triton.language on the first launch (kernels._jit)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights float32 [T, K], topk_ids int64 [T, K]): softmax over
    the experts in float32, the K largest, divided by their sum when `renormalize`."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_moe_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> None:
    """ValueError naming the first tensor whose shape or dtype does not fit the others."""
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a float [T, H] tensor, got {x.dtype} {tuple(x.shape)}")
    t, h = x.shape
    if w13.dim() != 3 or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, {h}], got {tuple(w13.shape)}")
    e, two_i, _ = w13.shape
    if tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"w2 must be [{e}, {h}, {two_i // 2}], got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights and topk_ids must both be [{t}, K], got {tuple(topk_weights.shape)} and "
                         f"{tuple(topk_ids.shape)}")


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The MoE MLP in torch ops, one expert at a time over the tokens routed to it (the CPU path
    and the kernels' reference). Ids < 0 contribute nothing."""
    check_moe_shapes(x, w13, w2, topk_weights, topk_ids)
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    for expert in torch.unique(flat_ids[flat_ids >= 0]).tolist():
        token, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        hidden = silu_and_mul_ref(x[token] @ w13[expert].t())
        y = (hidden @ w2[expert].t()) * topk_weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of the two grouped GEMMs; `block_m` is also the align step's padding of each expert's run."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MoEConfig.{name} must be a power of two >= 16, got {value}")
        if self.group_m < 1:
            raise ValueError(f"MoEConfig.group_m must be >= 1, got {self.group_m}")


def moe_config(num_slots: int, num_experts: int) -> MoEConfig:
    """Tiles for `num_slots` = T*K token slots over `num_experts` experts, by the slots an expert gets
    on average. Decode batches give each expert a handful (one 16-row block, a long BLOCK_K: the
    weight read is the cost); prefill gives each many, and larger row blocks re-read the weights less.
    GROUP_M keeps the row blocks of one expert on the same weight tile at the same time (L2 reuse)."""
    per_expert = num_slots / max(num_experts, 1)
    if per_expert < 16:
        return MoEConfig(16, 64, 128, group_m=8, num_warps=4, num_stages=4)
    if per_expert < 32:
        return MoEConfig(32, 64, 128, group_m=8, num_warps=4, num_stages=4)
    if per_expert < 96:
        return MoEConfig(64, 64, 64, group_m=8, num_warps=4, num_stages=4)
    return MoEConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3)


# One-hot elements (slots x experts) an align program holds at a time.
_ALIGN_TILE = 16384


def moe_align_size(num_slots: int, num_experts: int, block_m: int) -> int:
    """The padded length the align step allocates: every expert that gets a slot (at most
    min(E, T*K) of them) pads its run by at most block_m - 1, rounded up to whole blocks. Shapes
    only, so a CUDA graph captured for T holds for any routing."""
    worst = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return cdiv(worst, block_m) * block_m


def _moe_count_kernel(
    ids_ptr,  # [N] expert of each token slot (topk_ids flattened); outside [0, E) is none here
    counts_ptr,  # [C, BLOCK_E] int32 out: the slots of each expert in each chunk of BLOCK_S slots
    num_slots,
    num_experts,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    offs = chunk * BLOCK_S + tl.arange(0, BLOCK_S)
    ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
    hit = (ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)
    tl.store(counts_ptr + chunk * BLOCK_E + experts, tl.sum(hit.to(tl.int32), axis=0))


def _moe_place_kernel(
    ids_ptr,  # [N] expert of each token slot, as for _moe_count_kernel
    counts_ptr,  # [C, BLOCK_E] int32 per-chunk counts from _moe_count_kernel (unread when ONE_CHUNK)
    sorted_ptr,  # [P] int32 out: token slots by expert, ascending within an expert, each run padded with N
    block_expert_ptr,  # [P / BLOCK_M] int32 out: the expert of each block of sorted_ptr, -1 from `total` on
    total_ptr,  # [1] int32 out: the padded count `total` (sorted_ptr[total:] is left unwritten)
    num_slots,
    num_experts,
    num_chunks,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # all N slots in this one program: it counts them itself, no count launch
):
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    offs = chunk * BLOCK_S + tl.arange(0, BLOCK_S)
    ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
    hit = ((ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)).to(tl.int32)
    if ONE_CHUNK:
        counts = tl.sum(hit, axis=0)
        earlier = tl.zeros([BLOCK_E], dtype=tl.int32)
    else:
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        earlier = tl.zeros([BLOCK_E], dtype=tl.int32)  # each expert's slots in the chunks before this one
        for c0 in range(0, num_chunks, BLOCK_C):
            rows = c0 + tl.arange(0, BLOCK_C)
            cnt = tl.load(counts_ptr + rows[:, None] * BLOCK_E + experts[None, :],
                          mask=(rows < num_chunks)[:, None], other=0)
            counts += tl.sum(cnt, axis=0)
            earlier += tl.sum(tl.where((rows < chunk)[:, None], cnt, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded

    rank = tl.cumsum(hit, axis=0) - hit  # same-expert slots before each one in this chunk
    dest = tl.sum(hit * (rank + (starts + earlier)[None, :]), axis=1)
    tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=tl.sum(hit, axis=1) > 0)

    if chunk == 0:
        total = tl.sum(padded, axis=0)
        tl.store(total_ptr, total)
        lanes = tl.arange(0, BLOCK_M)
        pad_at = (starts + counts)[:, None] + lanes[None, :]
        sentinel = tl.zeros([BLOCK_E, BLOCK_M], dtype=tl.int32) + num_slots
        tl.store(sorted_ptr + pad_at, sentinel, mask=lanes[None, :] < (padded - counts)[:, None])
        for b0 in range(0, num_blocks, BLOCK_C):
            blocks = b0 + tl.arange(0, BLOCK_C)
            first = blocks * BLOCK_M
            # a block's expert: how many experts' runs end at or before its first position
            expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + blocks, tl.where(first < total, expert, -1), mask=blocks < num_blocks)


def _grouped_pid(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, column block) of this program, GROUP_M row blocks at a time along each column
    block, so that the programs running together share the weight tile in L2."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


def _moe_gate_up_kernel(
    x_ptr,  # [T, H], row stride stride_xt
    w_ptr,  # [E, 2I, H] gate rows then up rows; strides stride_we, stride_wn, 1
    out_ptr,  # [N, I] contiguous: silu(gate) * up of each token slot
    sorted_ptr,  # [P] int32 token slots by expert (padding = N)
    block_expert_ptr,  # [P / BLOCK_M] int32 each block's expert
    total_ptr,  # [1] int32 padded count: blocks from it on hold nothing
    num_slots,
    num_padded,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = _grouped_pid(num_padded // BLOCK_M, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rows_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=cols_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=cols_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < hidden - k0
            a = tl.load(a_ptrs, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # silu_and_mul's rounding: gate and up in x's dtype, silu(gate) rounded before the multiply
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out = act * acc_u.to(dtype).to(tl.float32)
    out_ptrs = out_ptr + slots[:, None].to(tl.int64) * inter + offs_n[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=rows_ok[:, None] & cols_ok[None, :])


def _moe_down_kernel(
    h_ptr,  # [N, I] contiguous: the gate/up kernel's output
    w_ptr,  # [E, H, I]; strides stride_we, stride_wn, 1
    weights_ptr,  # [N] routing weight of each token slot (topk_weights flattened)
    out_ptr,  # [N, H] contiguous: each slot's weighted expert output
    sorted_ptr,  # [P] int32 token slots by expert (padding = N)
    block_expert_ptr,  # [P / BLOCK_M] int32 each block's expert
    total_ptr,  # [1] int32 padded count
    num_slots,
    num_padded,
    hidden,
    inter,
    stride_we,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = _grouped_pid(num_padded // BLOCK_M, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = slots < num_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + slots[:, None].to(tl.int64) * inter + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rows_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=cols_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + slots, mask=rows_ok, other=0.0).to(dtype).to(tl.float32)
    out = acc.to(dtype).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + slots[:, None].to(tl.int64) * hidden + offs_n[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=rows_ok[:, None] & cols_ok[None, :])


def _moe_sum_kernel(
    y_ptr,  # [T*K, H] contiguous: the down kernel's output (rows of ids outside [0, E) unwritten)
    ids_ptr,  # [T*K] expert of each token slot
    out_ptr,  # [T, H] contiguous
    hidden,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = token * TOP_K + k
        expert = tl.load(ids_ptr + slot) + tl.zeros([BLOCK_H], dtype=tl.int32)
        here = mask & (expert >= 0) & (expert < num_experts)
        y = tl.load(y_ptr + slot * hidden + offs, mask=here, other=0.0)
        acc = (acc + y.to(tl.float32)).to(dtype).to(tl.float32)  # summed in x's dtype, as the reference
    tl.store(out_ptr + token * hidden + offs, acc.to(dtype), mask=mask)


_TRITON = TritonKernels(
    globals(), "_moe_count_kernel", "_moe_place_kernel", "_grouped_pid", "_moe_gate_up_kernel", "_moe_down_kernel",
    "_moe_sum_kernel",
    do_not_specialize={
        "_moe_count_kernel": ("num_slots",),
        "_moe_place_kernel": ("num_slots", "num_chunks", "num_blocks"),
        "_moe_gate_up_kernel": ("num_slots", "num_padded"),
        "_moe_down_kernel": ("num_slots", "num_padded"),
    },
)


def _align_tiles(num_slots: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_S slots a chunk, BLOCK_E experts padded to a power of two, BLOCK_C chunk rows a load)."""
    block_e = next_power_of_2(num_experts)
    block_s = max(16, min(next_power_of_2(num_slots), _ALIGN_TILE // block_e))
    block_c = max(16, _ALIGN_TILE // block_e)
    return block_s, block_e, block_c


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """The T*K token slots (slot = t * K + k) grouped by expert for blocks of `block_m` rows.

    Returns (sorted_slots int32 [P], block_experts int32 [P / block_m], total int32 [1]) with
    P = moe_align_size(T*K, E, block_m): expert e's slots ascending, then padding (the value T*K) up to
    a multiple of block_m, experts in order, `total` positions in all; block b holds expert
    block_experts[b], -1 from total on; sorted_slots[total:] is unspecified. Ids outside [0, E) get
    no position. One launch when the slots fit one chunk, else two (counts, then placement); no host
    sync."""
    check_tensor("topk_ids", topk_ids, 2, (torch.int64, torch.int32))
    num_slots = topk_ids.numel()
    padded = moe_align_size(num_slots, num_experts, block_m)
    device = topk_ids.device
    sorted_slots = torch.empty(padded, dtype=torch.int32, device=device)
    block_experts = torch.empty(padded // block_m, dtype=torch.int32, device=device)
    if num_slots == 0:
        return sorted_slots, block_experts, torch.zeros(1, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)  # the place kernel's first program writes it
    ids = topk_ids.reshape(-1)
    block_s, block_e, block_c = _align_tiles(num_slots, num_experts)
    num_chunks = cdiv(num_slots, block_s)
    counts = sorted_slots  # unread in one chunk
    if num_chunks > 1:
        counts = torch.empty((num_chunks, block_e), dtype=torch.int32, device=device)
        _TRITON.get("_moe_count_kernel")[(num_chunks,)](
            ids, counts, num_slots, num_experts, BLOCK_S=block_s, BLOCK_E=block_e, num_warps=8)
    _TRITON.get("_moe_place_kernel")[(num_chunks,)](
        ids, counts, sorted_slots, block_experts, total, num_slots, num_experts, num_chunks, padded // block_m,
        BLOCK_M=block_m, BLOCK_S=block_s, BLOCK_E=block_e, BLOCK_C=block_c, ONE_CHUNK=num_chunks == 1,
        num_warps=8)
    return sorted_slots, block_experts, total


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """The align step's oracle, in Python: (sorted_slots[:total], block_experts[:total / block_m])."""
    flat = topk_ids.reshape(-1).tolist()
    sorted_slots: list[int] = []
    block_experts: list[int] = []
    for expert in range(num_experts):
        slots = [i for i, e in enumerate(flat) if e == expert]
        blocks = cdiv(len(slots), block_m)
        sorted_slots += slots + [len(flat)] * (blocks * block_m - len(slots))
        block_experts += [expert] * blocks
    return sorted_slots, block_experts


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: MoEConfig | None = None) -> torch.Tensor:
    """The Triton path of `fused_moe` (same shapes and rounding); `config` overrides `moe_config`.
    Allocates for the worst-case padding of its shapes and never syncs: capturable in a CUDA graph."""
    check_moe_shapes(x, w13, w2, topk_weights, topk_ids)
    check_tensor("x", x, 2)
    for name, w in (("w13", w13), ("w2", w2)):
        check_tensor(name, w, 3)
        if w.dtype != x.dtype:
            raise ValueError(f"{name} dtype {w.dtype} must match x's {x.dtype}")
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_slots == 0:
        return out.zero_()
    cfg = config or moe_config(num_slots, num_experts)
    ids = topk_ids.contiguous()
    sorted_slots, block_experts, total = moe_align(ids, num_experts, cfg.block_m)
    num_padded = sorted_slots.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    act = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    grid = (num_padded // cfg.block_m * cdiv(inter, cfg.block_n),)
    _TRITON.get("_moe_gate_up_kernel")[grid](
        x, w13, act, sorted_slots, block_experts, total, num_slots, num_padded, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), TOP_K=top_k, EVEN_K=hidden % cfg.block_k == 0, **launch)

    y = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    grid = (num_padded // cfg.block_m * cdiv(hidden, cfg.block_n),)
    _TRITON.get("_moe_down_kernel")[grid](
        act, w2, topk_weights.reshape(-1), y, sorted_slots, block_experts, total, num_slots, num_padded, hidden,
        inter, w2.stride(0), w2.stride(1), EVEN_K=inter % cfg.block_k == 0, **launch)

    block_h = min(1024, next_power_of_2(hidden))
    _TRITON.get("_moe_sum_kernel")[(num_tokens, cdiv(hidden, block_h))](
        y, ids, out, hidden, num_experts, TOP_K=top_k, BLOCK_H=block_h, num_warps=4)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """[T, H] output of the MoE MLP (see the module docstring for shapes and rounding)."""
    if kernel_backend(x.device) == "triton":
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
