"""The sparse mixture-of-experts MLP shared by the MoE families (Mixtral, Qwen3-MoE, OLMoE).

    router logits = x @ gate.T                   [T, E]   the router is replicated on every rank
    weights, ids  = softmax top-k (renormalized or not, as the family says)
    out           = sum_k weights[:, k] * expert_{ids[:, k]}(x)

The experts are held stacked as `pdserve.kernels.fused_moe` takes them: w13 [E', 2I', H] (each
expert's gate rows, then its up rows) and w2 [E', H, I']. Of the model's E experts of width I a
rank holds:

- tensor parallelism: every expert, I' = I / N of its width (gate/up rows and down columns);
- expert parallelism: E' = E / N whole experts, [first, first + E'); the router's ids of the
  others become -1 and contribute nothing.

Either way the output is this rank's partial sum, all-reduced by the caller like the dense MLP's.
The router's auxiliary outputs (load-balancing losses) are training-only and not computed.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve import kernels
from pdserve.config import MoEConfig
from pdserve.kernels.fused_moe import fused_moe, moe_route


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoEConfig, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 experts: range, intermediate_size: int) -> None:
        """`experts`: the ids of the experts this rank holds; `intermediate_size`: the width of
        each held expert (the whole width, or this rank's share of it)."""
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.num_experts = moe.num_experts
        self.experts = experts
        self.intermediate_size = intermediate_size
        self.gate = nn.Parameter(torch.empty(moe.num_experts, hidden_size, **kw), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(len(experts), 2 * intermediate_size, hidden_size, **kw),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(len(experts), hidden_size, intermediate_size, **kw),
                               requires_grad=False)

    @property
    def holds_all_experts(self) -> bool:
        return len(self.experts) == self.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], this rank's partial sum (see the module docstring)."""
        router_logits = kernels.linear(x, self.gate)
        topk_weights, topk_ids = moe_route(router_logits, self.top_k, self.renormalize)
        if not self.holds_all_experts:
            local = topk_ids - self.experts.start
            topk_ids = local.masked_fill((local < 0) | (local >= len(self.experts)), -1)
        return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)

    def target(self, expert: int, proj: str) -> tuple[torch.Tensor, tuple]:
        """Where the HF weight `experts.<expert>.<proj>.weight` goes: (tensor, index), the
        expert given by its model-wide id (one this rank holds)."""
        local = expert - self.experts.start
        i = self.intermediate_size
        if proj == "gate_proj":
            return self.w13.data, (local, slice(0, i))
        if proj == "up_proj":
            return self.w13.data, (local, slice(i, 2 * i))
        if proj == "down_proj":
            return self.w2.data, (local,)
        raise ValueError(f"unexpected expert projection {proj!r}")
