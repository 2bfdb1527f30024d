"""Tiny random Hugging Face models of each family, saved as safetensors directories."""

from __future__ import annotations

import pytest
import torch

FAMILIES = {
    "llama": dict(cls="LlamaConfig", extra=dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0)),
    "qwen2": dict(cls="Qwen2Config", extra=dict()),
    "mistral": dict(cls="MistralConfig", extra=dict(sliding_window=None)),
    "tied": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=True)),
    # head_dim 32, not hidden / heads (16); tied like Qwen3-0.6B
    "qwen3": dict(cls="Qwen3Config", extra=dict(head_dim=32, tie_word_embeddings=True)),
    "mixtral": dict(cls="MixtralConfig", extra=dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # layer 1 dense (mlp_only_layers), experts of their own width, top-k renormalized
    "qwen3_moe": dict(cls="Qwen3MoeConfig", extra=dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                                                       head_dim=16)),
    # q/k norms over the whole projection, q/k/v clipped, top-k not renormalized
    "olmoe": dict(cls="OlmoeConfig", extra=dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
                                                clip_qkv=2.0)),
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
# the Llama family proper; the others' batched and chunked greedy runs are in test_model_families
LLAMA_FAMILIES = ("llama", "qwen2", "mistral", "tied")


def build_hf_model(family: str, seed: int = 0):
    import transformers

    spec = FAMILIES[family]
    cfg_cls = getattr(transformers, spec["cls"])
    kw = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.25, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=0,
              pad_token_id=None)
    if family == "qwen2":
        kw.update(num_attention_heads=6, num_key_value_heads=2, hidden_size=96)  # GQA 3
    kw.update(spec["extra"])
    config = cfg_cls(**kw)
    torch.manual_seed(seed)
    model_cls = {"LlamaConfig": transformers.LlamaForCausalLM,
                 "Qwen2Config": transformers.Qwen2ForCausalLM,
                 "MistralConfig": transformers.MistralForCausalLM,
                 "Qwen3Config": transformers.Qwen3ForCausalLM,
                 "MixtralConfig": transformers.MixtralForCausalLM,
                 "Qwen3MoeConfig": transformers.Qwen3MoeForCausalLM,
                 "OlmoeConfig": transformers.OlmoeForCausalLM}[spec["cls"]]
    model = model_cls(config).float().eval()
    with torch.no_grad():  # norms away from 1 so they matter; biases non-zero (Qwen2)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
            elif name.endswith("mlp.gate.weight"):  # routers with clear preferences: no near-ties
                p.copy_(torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """family -> (transformers model, saved directory)."""
    out = {}
    for family in FAMILIES:
        model = build_hf_model(family)
        path = tmp_path_factory.mktemp(f"hf-{family}")
        model.save_pretrained(path)
        out[family] = (model, str(path))
    return out
