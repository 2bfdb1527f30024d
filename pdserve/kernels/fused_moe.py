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
"""

from __future__ import annotations

import torch

from pdserve.kernels.activation import silu_and_mul_ref

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


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """[T, H] output of the MoE MLP (see the module docstring for shapes and rounding)."""
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
