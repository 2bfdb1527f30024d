"""The Hugging Face weight layout every loader produces, and checks against it.

Llama names and shapes (out_features, in_features), plus Qwen3's and OLMoE's
`self_attn.q_norm` / `k_norm` and, in a sparse layer, the router `mlp.gate.weight` [E, H] and each
expert's `mlp.experts.<e>.{gate,up,down}_proj.weight` (the per-expert layout of Qwen3-MoE and OLMoE
checkpoints; loaders rename Mixtral's `block_sparse_moe.experts.<e>.w1/w3/w2` and split stacked
expert tensors into it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from pdserve.config import ModelConfig

_LAYER_PREFIX = "model.layers.{i}."
_EXPERT_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> torch shape (out_features, in_features) of every weight the model needs."""
    h, q, kv, ff = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = _LAYER_PREFIX.format(i=i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if config.qk_norm != "none":
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,) if config.qk_norm == "head" else (q,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,) if config.qk_norm == "head" else (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.moe is not None and config.is_moe_layer(i):
            moe = config.moe
            shapes[p + "mlp.gate.weight"] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (moe.intermediate_size, h)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (moe.intermediate_size, h)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, moe.intermediate_size)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (ff, h)
        shapes[p + "mlp.up_proj.weight"] = (ff, h)
        shapes[p + "mlp.down_proj.weight"] = (h, ff)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_weight_shapes(
    found: Mapping[str, tuple[int, ...]],
    config: ModelConfig,
    where: str,
    display_name: Callable[[str], str] = lambda name: name,
) -> None:
    """ValueError naming `where` if a weight is missing, unexpected, or has the wrong shape.

    `display_name` turns an HF name into the name the file uses, for messages.
    """
    expected = expected_weight_shapes(config)
    for name, shape in expected.items():
        if name not in found:
            raise ValueError(f"{where}: missing tensor {display_name(name)}")
        if tuple(found[name]) != shape:
            raise ValueError(
                f"{where}: tensor {display_name(name)} has shape {tuple(found[name])}, "
                f"expected {shape} from the model config"
            )
    for name in found:
        if name not in expected:
            expert = _EXPERT_RE.match(name)
            if expert and config.moe is not None and int(expert.group(1)) >= config.moe.num_experts:
                raise ValueError(f"{where}: unexpected tensor {display_name(name)}: expert {expert.group(1)} of a "
                                 f"model config of {config.moe.num_experts} experts")
            raise ValueError(f"{where}: unexpected tensor {display_name(name)}")
