"""Qwen3 and the mixture-of-experts families against transformers' own greedy generate (fp32, CPU).

The logits of every family are compared step by step in test_model_vs_transformers (its FAMILIES
include these); here the engine's greedy tokens equal `generate`'s, from both expert layouts
transformers 5 writes, and each family's own feature is shown to matter.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.llm import LLM
from pdserve.loaders import load_model_source
from pdserve.sampling_params import SamplingParams

from .conftest import MOE_FAMILIES, build_hf_model
from .test_model_vs_transformers import prompts

NEW_FAMILIES = ("qwen3", *MOE_FAMILIES)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def hf_generate(model, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_greedy_tokens_equal_transformers_generate(hf_models, family):
    model, path = hf_models[family]
    llm = LLM(path, dtype="float32", device="cpu", num_blocks=64, max_num_batched_tokens=11)
    batch = prompts(2, seed=5)
    outs = llm.generate(batch, SamplingParams(max_tokens=16, **GREEDY))
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_generate(model, prompt, 16)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_stacked_expert_layout_gives_the_same_tokens(hf_models, tmp_path, family):
    """save_pretrained(save_original_format=False) writes the experts stacked, as transformers 5
    holds them (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    from safetensors import safe_open

    model, per_expert = hf_models[family]
    model.save_pretrained(tmp_path, save_original_format=False)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)
    ref = LLM(per_expert, dtype="float32", device="cpu", num_blocks=32)
    stacked = LLM(str(tmp_path), dtype="float32", device="cpu", num_blocks=32)
    for name, param in ref.engine.runner.model.named_parameters():
        assert torch.equal(dict(stacked.engine.runner.model.named_parameters())[name], param), name
    prompt = prompts(1, seed=6, lo=20, hi=21)[0]
    out = stacked.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert out.token_ids == hf_generate(model, prompt, 12)


def test_qwen3_config_head_dim_and_norms(hf_models):
    _, path = hf_models["qwen3"]
    c = load_model_source(path).config
    assert (c.architecture, c.head_dim, c.hidden_size // c.num_heads, c.qk_norm) == ("qwen3", 32, 16, "head")
    assert c.tie_word_embeddings and not c.attention_bias and c.moe is None
    llm = LLM(path, dtype="float32", device="cpu", num_blocks=8, block_size=16)
    # K and V of 2 KV heads of 32 a layer, 3 layers, 4 bytes: from head_dim, not hidden / heads
    assert llm.engine.runner.kv_bytes_per_token == 2 * 3 * 2 * 32 * 4
    assert llm.engine.runner.kv_caches[0][0].shape == (8, 16, 2, 32)


def test_moe_configs_read_from_config_json(hf_models):
    mixtral = load_model_source(hf_models["mixtral"][1]).config
    assert mixtral.architecture == "mixtral" and mixtral.qk_norm == "none"
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.renormalize) == (4, 2, True)
    assert mixtral.moe.layers == (0, 1, 2) and mixtral.moe.intermediate_size == 96
    qwen = load_model_source(hf_models["qwen3_moe"][1]).config
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.intermediate_size, qwen.moe.renormalize) == (8, 3, 32, True)
    assert qwen.moe.layers == (0, 2) and qwen.intermediate_size == 96 and qwen.qk_norm == "head"
    layers = LLM(hf_models["qwen3_moe"][1], dtype="float32", device="cpu", num_blocks=4).engine.runner.model.layers
    assert [layer.moe is None for layer in layers] == [False, True, False]  # mlp_only_layers=[1]
    assert layers[1].gate_up_proj.shape == (2 * 96, 64) and layers[0].moe.w13.shape == (8, 2 * 32, 64)
    olmoe = load_model_source(hf_models["olmoe"][1]).config
    assert (olmoe.moe.num_experts, olmoe.moe.top_k, olmoe.moe.renormalize) == (6, 2, False)
    assert (olmoe.qk_norm, olmoe.clip_qkv) == ("proj", 2.0)


@pytest.mark.parametrize("family, change", [
    ("olmoe", dict(clip_qkv=None)),             # the clip cuts some q/k/v values of this model
    ("qwen3_moe", dict(norm_topk_prob=False)),  # renormalized top-k weights
])
def test_each_family_feature_changes_the_output(hf_models, family, change):
    """The tiny models are built so that the feature under test changes the logits: the
    comparison with transformers above would catch a feature left out."""
    model, _ = hf_models[family]
    for key, value in change.items():
        assert getattr(model.config, key) != value
    other = build_hf_model(family)
    other.load_state_dict(model.state_dict())  # the same weights, one setting changed
    for key, value in change.items():
        setattr(other.config, key, value)
        for module in other.modules():
            if hasattr(module, key):
                setattr(module, key, value)
    ids = torch.tensor([prompts(1, seed=7, lo=30, hi=31)[0]])
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, other(ids).logits, atol=1e-3)
