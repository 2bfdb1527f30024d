"""The Hugging Face Llama weight layout every loader produces, and checks against it."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pdserve.config import ModelConfig

_LAYER_PREFIX = "model.layers.{i}."


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
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
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
            raise ValueError(f"{where}: unexpected tensor {display_name(name)}")
