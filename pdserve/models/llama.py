"""The Llama-style decoder over a paged KV cache, and the families built on it: Llama 2/3/3.x,
Qwen2/2.5, Mistral, SmolLM2, Qwen3 (RMSNorm of each q and k head before RoPE), and the
mixture-of-experts families Mixtral, Qwen3-MoE and OLMoE (the sparse MLP of `models.moe` in the
layers `ModelConfig.moe` names; OLMoE also normalizes q and k over the whole projection and may
clip q, k and v). The features are the config's (`qk_norm`, `clip_qkv`, `moe`), not the name's.

Q/K/V and gate/up projections are fused into one matmul each. Attention reads the paged cache
through `kernels` (Triton on CUDA, torch on CPU). The batch is varlen and flat: the first
`num_decodes` rows are decode tokens (one per request), the rest are prefill chunks.

Under tensor parallelism (`pdserve.parallel`) the model holds one rank's shard: its query and
KV heads, its MLP columns and its vocabulary rows (`TPLayout`); `self.config` is that rank's
local shape. o_proj and down_proj outputs and the embedding are all-reduced, the logits
all-gathered; a sparse MLP's partial sum (its experts' shares, or its own experts) is
all-reduced as the dense one's. Without a `TPComm` none of that runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from torch import nn

from pdserve import kernels
from pdserve.config import ModelConfig
from pdserve.models.moe import SparseMoeBlock

if TYPE_CHECKING:
    from pdserve.parallel.comm import TPComm
    from pdserve.parallel.layout import TPLayout


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset
    num_decodes: int  # rows [0, num_decodes) are decodes, one token per request
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int32, context incl. the new token
    prefill_block_tables: torch.Tensor | None  # [P, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor | None  # [P + 1] int32, offsets within the prefill rows
    prefill_seq_lens: torch.Tensor | None  # [P] int32, context incl. the chunk
    logits_indices: torch.Tensor  # [N] int64, rows whose hidden state gives logits
    # every prefill sequence starts at position 0 (no cached prefix) and the runner's prefill
    # attention reads the step's own K/V for them (ModelRunner.dense_prefill)
    prefill_dense: bool = False
    prefill_max_q_len: int = 0  # with prefill_dense: the most rows of one prefill sequence
    # torch (CPU) path only: per-step tables shared by every layer
    rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, signed sin) [T, 1, D]
    decode_plan: tuple[torch.Tensor, torch.Tensor | None, int] | None = None  # decode_gather_plan


LayerHook = Callable[[int], None]  # called with the layer index once its KV is in the cache


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 layout: "TPLayout | None" = None, comm: "TPComm | None" = None) -> None:
        """`config`: the whole model's shape; `layout` and `comm`: this rank's shard and its
        collectives (both or neither; a layout of size 1 is the whole model)."""
        super().__init__()
        if (layout is not None and layout.size > 1) != (comm is not None):
            raise AssertionError("a tensor-parallel model needs both its layout and its comm")
        self.layout = layout if layout is not None and layout.size > 1 else None
        self.comm = comm
        self.config = c = self.layout.local_config() if self.layout else config
        kw = {"dtype": dtype, "device": device}
        vocab_rows = self.layout.vocab_per_rank if self.layout else c.vocab_size
        empty = torch.zeros if self.layout else torch.empty  # padding rows of the last rank stay 0
        self.embed_tokens = nn.Parameter(empty(vocab_rows, c.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(c, dtype, device, comm, i, self.layout)
                                    for i in range(c.num_layers))
        self.norm = nn.Parameter(torch.empty(c.hidden_size, **kw), requires_grad=False)
        if c.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(empty(vocab_rows, c.hidden_size, **kw), requires_grad=False)
        self.scale = c.head_dim ** -0.5
        self.register_buffer(
            "cos_sin",
            kernels.rope_cos_sin_cache(c.head_dim, c.max_position_embeddings, c.rope_theta,
                                       c.rope_scaling, device=device),
            persistent=False,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """Returns logits [N, vocab] (float32) for the rows in `meta.logits_indices`."""
        hidden = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, meta, kv_caches[index], self.cos_sin, self.scale)
            if layer_hook is not None:
                layer_hook(index)
        return self.logits_of(hidden, residual, meta.logits_indices)  # type: ignore[arg-type]

    def logits_of(self, hidden: torch.Tensor, residual: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The last layer's (hidden, residual) -> float32 logits of the rows in `indices`."""
        hidden, _ = kernels.rms_norm(hidden[indices], self.norm, self.config.rms_norm_eps, residual[indices])
        return self.compute_logits(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]. Vocab-parallel: each rank looks up the ids in its rows
        (zeros elsewhere) and the ranks sum; no branch on values, so it can be captured."""
        if self.layout is None:
            return self.embed_tokens[input_ids]
        start, end = self.layout.vocab_range
        outside = (input_ids < start) | (input_ids >= end)
        local = (input_ids - start).masked_fill(outside, 0)
        hidden = self.embed_tokens[local].masked_fill(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(hidden)  # type: ignore[union-attr]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]; vocab-parallel: gathered from every rank."""
        logits = kernels.linear(hidden, self.lm_head).float()
        if self.layout is None:
            return logits
        return self.comm.all_gather_last(logits)[:, :self.config.vocab_size]  # type: ignore[union-attr]

    def pack_weights(self) -> None:
        """Puts the projections and the LM head in MKL's packed GEMM layout (fp32 on the CPU;
        see pdserve/kernels/linear.py), dropping their dense tensors. A tied LM head gets a packed
        copy of its own: the embedding table stays dense for the lookups."""
        for layer in self.layers:
            for name in PROJECTIONS:
                if getattr(layer, name, None) is not None:  # a sparse layer has no dense MLP
                    _replace_weight(layer, name, kernels.PackedWeight(getattr(layer, name)))
        _replace_weight(self, "lm_head", kernels.PackedWeight(self.lm_head))

    @property
    def packed_weights(self) -> bool:
        return isinstance(self.lm_head, kernels.PackedWeight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads Hugging Face-named tensors, fusing q/k/v and gate/up. Every parameter must
        be set exactly once; a missing or unexpected tensor raises ValueError. Under tensor
        parallelism the tensors are this rank's slices (`TPLayout.shard_index`); under expert
        parallelism the weights of the experts other ranks hold are skipped."""
        c = self.config
        expected = set(self.expected_weight_names())
        seen: set[str] = set()
        for name, tensor in weights:
            if name not in expected:
                if name.endswith("rotary_emb.inv_freq") or self._other_ranks_expert(name):
                    continue
                raise ValueError(f"unexpected weight {name!r}")
            target, rows = self._target(name)  # rows: an index into target
            if tuple(tensor.shape) != tuple(target[rows].shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target[rows].shape)}")
            target[rows].copy_(tensor)
            seen.add(name)
        missing = expected - seen
        if c.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"missing weights: {', '.join(sorted(missing)[:5])}"
                             + (" ..." if len(missing) > 5 else ""))

    def expected_weight_names(self) -> Iterator[str]:
        yield "model.embed_tokens.weight"
        yield "model.norm.weight"
        if not self.config.tie_word_embeddings:
            yield "lm_head.weight"
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight"
            yield p + "post_attention_layernorm.weight"
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                yield p + f"self_attn.{proj}.weight"
            if self.config.attention_bias:
                for proj in ("q_proj", "k_proj", "v_proj"):
                    yield p + f"self_attn.{proj}.bias"
            if self.config.qk_norm != "none":
                yield p + "self_attn.q_norm.weight"
                yield p + "self_attn.k_norm.weight"
            moe = self.layers[i].moe
            if moe is None:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    yield p + f"mlp.{proj}.weight"
                continue
            yield p + "mlp.gate.weight"
            for e in moe.experts:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    yield p + f"mlp.experts.{e}.{proj}.weight"

    def _other_ranks_expert(self, name: str) -> bool:
        """Whether `name` is a weight of an expert of a sparse layer this rank does not hold."""
        parts = name.split(".")
        if len(parts) != 8 or parts[:2] != ["model", "layers"] or parts[3:5] != ["mlp", "experts"]:
            return False
        if not (parts[2].isdigit() and parts[5].isdigit()) or int(parts[2]) >= len(self.layers):
            return False
        moe = self.layers[int(parts[2])].moe
        return moe is not None and int(parts[5]) not in moe.experts and int(parts[5]) < moe.num_experts

    def _target(self, name: str) -> tuple[torch.Tensor, slice | tuple]:
        c = self.config
        everything = slice(None)
        vocab_rows = everything
        if self.layout is not None:  # the last rank's padding rows get no weights
            start, end = self.layout.vocab_range
            vocab_rows = slice(0, end - start)
        if name == "model.embed_tokens.weight":
            return self.embed_tokens.data, vocab_rows
        if name == "model.norm.weight":
            return self.norm.data, everything
        if name == "lm_head.weight":
            return self.lm_head.data, vocab_rows
        parts = name.split(".")
        layer: DecoderLayer = self.layers[int(parts[2])]  # type: ignore[assignment]
        sub = ".".join(parts[3:])
        qkv_rows = {"q_proj": slice(0, c.q_size), "k_proj": slice(c.q_size, c.q_size + c.kv_size),
                    "v_proj": slice(c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)}
        if sub == "input_layernorm.weight":
            return layer.input_norm.data, everything
        if sub == "post_attention_layernorm.weight":
            return layer.post_norm.data, everything
        if sub == "self_attn.o_proj.weight":
            return layer.o_proj.data, everything
        if sub == "self_attn.q_norm.weight":
            return layer.q_norm.data, everything  # type: ignore[union-attr]
        if sub == "self_attn.k_norm.weight":
            return layer.k_norm.data, everything  # type: ignore[union-attr]
        if sub.startswith("self_attn.") and sub.endswith(".weight"):
            return layer.qkv_proj.data, qkv_rows[parts[4]]
        if sub.startswith("self_attn.") and sub.endswith(".bias"):
            return layer.qkv_bias.data, qkv_rows[parts[4]]  # type: ignore[union-attr]
        if layer.moe is not None:
            if sub == "mlp.gate.weight":
                return layer.moe.gate.data, everything
            if sub.startswith("mlp.experts."):  # mlp.experts.<e>.<proj>.weight
                return layer.moe.target(int(parts[5]), parts[6])
        if sub == "mlp.gate_proj.weight":
            return layer.gate_up_proj.data, slice(0, c.intermediate_size)
        if sub == "mlp.up_proj.weight":
            return layer.gate_up_proj.data, slice(c.intermediate_size, 2 * c.intermediate_size)
        if sub == "mlp.down_proj.weight":
            return layer.down_proj.data, everything
        raise ValueError(f"unexpected weight {name!r}")


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _replace_weight(module: nn.Module, name: str, value: kernels.PackedWeight) -> None:
    module._parameters.pop(name, None)  # a plain attribute from now on
    setattr(module, name, value)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device,
                 comm: "TPComm | None" = None, index: int = 0, layout: "TPLayout | None" = None) -> None:
        """`c`: this rank's shape; `index`: the layer's (whether its MLP is sparse)."""
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.c = c
        self.comm = comm  # row-parallel o_proj and down_proj: their outputs are summed over ranks
        self.q_norm = self.k_norm = None
        if c.qk_norm != "none":  # per head: one weight of head_dim; per projection: this rank's slice
            q_rows, k_rows = (c.head_dim, c.head_dim) if c.qk_norm == "head" else (c.q_size, c.kv_size)
            self.q_norm = nn.Parameter(torch.empty(q_rows, **kw), requires_grad=False)
            self.k_norm = nn.Parameter(torch.empty(k_rows, **kw), requires_grad=False)
        # per projection under TP: the mean square is over the whole model's q (k) projection, every
        # KV head counted once although it lives on kv_replicas ranks
        whole = layout.config if layout is not None else c
        replicas = layout.kv_replicas if layout is not None else 1
        self._proj_norm_sizes = (float(whole.q_size), float(whole.kv_size * replicas))
        self.moe: SparseMoeBlock | None = None
        if c.is_moe_layer(index):
            experts = layout.expert_range if layout is not None else range(c.moe.num_experts)  # type: ignore[union-attr]
            self.moe = SparseMoeBlock(c.moe, c.hidden_size, dtype, device, experts,  # type: ignore[arg-type]
                                      c.moe.intermediate_size)  # type: ignore[union-attr]
        self.input_norm = nn.Parameter(torch.empty(c.hidden_size, **kw), requires_grad=False)
        self.post_norm = nn.Parameter(torch.empty(c.hidden_size, **kw), requires_grad=False)
        self.qkv_proj = nn.Parameter(torch.empty(c.q_size + 2 * c.kv_size, c.hidden_size, **kw),
                                     requires_grad=False)
        self.qkv_bias = (nn.Parameter(torch.empty(c.q_size + 2 * c.kv_size, **kw), requires_grad=False)
                         if c.attention_bias else None)
        self.o_proj = nn.Parameter(torch.empty(c.hidden_size, c.q_size, **kw), requires_grad=False)
        self.gate_up_proj = self.down_proj = None
        if self.moe is None:
            self.gate_up_proj = nn.Parameter(torch.empty(2 * c.intermediate_size, c.hidden_size, **kw),
                                             requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size, **kw),
                                          requires_grad=False)

    def project_qkv(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> qkv [T, q + 2 kv]: the projection, then the family's q/k norm and clip, in
        place (into `out` when given: q, k and v are then views of it)."""
        c = self.c
        qkv = kernels.linear(x, self.qkv_proj, self.qkv_bias)
        if out is not None:
            qkv = out.copy_(qkv)
        if self.q_norm is not None:
            self._norm_qk(qkv)
        if c.clip_qkv is not None:
            qkv.clamp_(-c.clip_qkv, c.clip_qkv)
        return qkv

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        c, eps = self.c, self.c.rms_norm_eps
        t = qkv.shape[0]
        q = qkv[:, :c.q_size]
        k = qkv[:, c.q_size:c.q_size + c.kv_size]
        if c.qk_norm == "head":
            q, k = q.view(t, c.num_heads, c.head_dim), k.view(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm == "head" or self.comm is None:
            q.copy_(kernels.rms_norm_ref(q, self.q_norm, eps))
            k.copy_(kernels.rms_norm_ref(k, self.k_norm, eps))
            return
        # over the whole projection, split across ranks: the squares are summed over the ranks
        squares = torch.stack([q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)], dim=-1)
        self.comm.all_reduce(squares)
        q_size, k_size = self._proj_norm_sizes
        for part, weight, total, size in ((q, self.q_norm, squares[:, :1], q_size),
                                          (k, self.k_norm, squares[:, 1:], k_size)):
            normed = part.float() * torch.rsqrt(total / size + eps)
            part.copy_(weight * normed.to(part.dtype))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of x [T, H], dense or sparse; under TP or EP this rank's partial sum."""
        if self.moe is not None:
            return self.moe(x)
        return kernels.linear(kernels.silu_and_mul(kernels.linear(x, self.gate_up_proj)), self.down_proj)

    def forward(self, hidden, residual, meta: AttentionMetadata, kv_cache, cos_sin, scale):
        c = self.c
        k_cache, v_cache = kv_cache
        if meta.rope_tables is not None:  # torch path: fewer, larger ops
            x, residual = self.input_norm_of(hidden, residual)
            qkv = self.project_qkv(x)
            heads = qkv.view(qkv.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim)
            qk = kernels.apply_rope_tables(heads[:, :c.num_heads + c.num_kv_heads], *meta.rope_tables)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = heads[:, c.num_heads + c.num_kv_heads:]
            fresh_kv = None
            if k_cache.dtype == kernels.FP8_DTYPE:
                kernels.write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
            else:
                k_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, meta.slot_mapping, k)
                v_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, meta.slot_mapping, v)
        else:
            # Fresh prompts: attention reads the step's own rotated k and v (contiguous rows)
            dense = meta.prefill_dense
            q, k, v, residual = self.pre_attention(hidden, residual, meta.positions, meta.slot_mapping,
                                                   kv_cache, cos_sin, rotate_k=dense)
            fresh_kv = (k[meta.num_decodes:], v[meta.num_decodes:]) if dense else None
        attn = step_attention(q, k_cache, v_cache, meta, scale, fresh_kv)
        return self.post_attention(attn, residual)

    def input_norm_of(self, hidden, residual):
        """(normed input, residual): the first layer's residual is its input."""
        if residual is None:
            return kernels.rms_norm(hidden, self.input_norm, self.c.rms_norm_eps), hidden
        return kernels.rms_norm(hidden, self.input_norm, self.c.rms_norm_eps, residual)

    def pre_attention(self, hidden, residual, positions, slot_mapping, kv_cache, cos_sin,
                      rotate_k: bool = False, qkv_out: torch.Tensor | None = None):
        """The kernels path up to attention: input norm, QKV projection, RoPE and the KV write
        at `slot_mapping` (negative slots skipped). Returns (q, k, v, residual), q [T, Hq, D]
        and k, v [T, Hkv, D]; `rotate_k`: k is rotated in place too. `qkv_out` [T, q + 2 kv]:
        the projection is copied there first and k, v are views of it (a static buffer of
        `pdserve.piecewise_graphs`)."""
        c = self.c
        x, residual = self.input_norm_of(hidden, residual)
        qkv = self.project_qkv(x, qkv_out)
        q, k, v = split_qkv(qkv, c)
        k_cache, v_cache = kv_cache
        q = kernels.rope_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                                  rotate_k=rotate_k)
        return q, k, v, residual

    def post_attention(self, attn, residual):
        """o_proj (all-reduced under TP), the post-attention norm and the MLP: (hidden, residual)."""
        c = self.c
        hidden = kernels.linear(attn.reshape(attn.shape[0], c.q_size), self.o_proj)
        if self.comm is not None:
            self.comm.all_reduce(hidden)
        x, residual = kernels.rms_norm(hidden, self.post_norm, c.rms_norm_eps, residual)
        hidden = self.mlp(x)
        if self.comm is not None:
            self.comm.all_reduce(hidden)
        return hidden, residual


def split_qkv(qkv: torch.Tensor, c: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of a QKV projection [T, q + 2 kv] as q [T, Hq, D], k and v [T, Hkv, D]."""
    q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
    t = qkv.shape[0]
    return (q.view(t, c.num_heads, c.head_dim), k.view(t, c.num_kv_heads, c.head_dim),
            v.view(t, c.num_kv_heads, c.head_dim))


def step_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The step's attention: decode rows then prefill rows; into `out` [T, Hq, D] when given."""
    nd = meta.num_decodes
    if nd == q.shape[0] and out is None:
        return kernels.decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                        meta.decode_seq_lens, scale)
    if nd == 0 and out is None:
        return kernels.prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables,
                                         meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale,
                                         fresh_kv, meta.prefill_max_q_len)
    if out is None:
        out = torch.empty_like(q)
    if nd:
        out[:nd] = kernels.decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                            meta.decode_seq_lens, scale)
    if nd < q.shape[0]:
        out[nd:] = kernels.prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_block_tables,
                                             meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale,
                                             fresh_kv, meta.prefill_max_q_len)
    return out


def decode_forward_torch(model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                         input_ids: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                         slot_mapping: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None,
                         logits_indices: torch.Tensor) -> torch.Tensor:
    """The decode-only forward of the torch (CPU) path, eager or through `torch.compile`: one
    token per request, no Python branches on tensor values, no layer hook. The kernels'
    torch references, with RoPE tables and one gather plan per step (`slots` [B, L] from
    `decode_gather_plan`). Returns float32 logits of the rows in `logits_indices`."""
    c = model.config
    nh, nk, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    batch, length = slots.shape
    plan = (slots.reshape(-1), mask, length)
    comm = model.comm
    hidden = model.embed(input_ids)
    residual = hidden
    for index, layer in enumerate(model.layers):
        if index:
            residual = hidden + residual
        x = kernels.rms_norm_ref(residual, layer.input_norm, eps)
        heads = layer.project_qkv(x).view(batch, nh + 2 * nk, d)
        qk = kernels.apply_rope_tables(heads[:, :nh + nk], cos, signed_sin)
        k_cache, v_cache = kv_caches[index]
        if k_cache.dtype == kernels.FP8_DTYPE:
            kernels.write_kv_cache_ref(qk[:, nh:], heads[:, nh + nk:], k_cache, v_cache, slot_mapping)
        else:
            k_cache.view(-1, nk, d).index_copy_(0, slot_mapping, qk[:, nh:])
            v_cache.view(-1, nk, d).index_copy_(0, slot_mapping, heads[:, nh + nk:])
        attn = kernels.decode_attention_planned(qk[:, :nh], k_cache, v_cache, plan, model.scale)
        out = kernels.linear(attn.reshape(batch, nh * d), layer.o_proj)
        if comm is not None:
            comm.all_reduce(out)
        residual = out + residual
        x = kernels.rms_norm_ref(residual, layer.post_norm, eps)
        if layer.moe is not None:
            hidden = layer.moe(x)
        else:
            hidden = kernels.linear(kernels.silu_and_mul_ref(kernels.linear(x, layer.gate_up_proj)), layer.down_proj)
        if comm is not None:
            comm.all_reduce(hidden)
    residual = (hidden + residual)[logits_indices]
    x = kernels.rms_norm_ref(residual, model.norm, eps)
    return model.compute_logits(x)
