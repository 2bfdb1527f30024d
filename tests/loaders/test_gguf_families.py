"""GGUF files of Qwen3 and the mixture-of-experts families, written here as llama.cpp's converter
writes them, from the same tiny transformers models as tests/engine: the config read back, the
weights equal to the model's, and greedy tokens equal to transformers' generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.llm import LLM
from pdserve.loaders import load_model_source
from pdserve.sampling_params import SamplingParams
from tests.engine.conftest import build_hf_model
from tests.engine.test_model_families import hf_generate
from tests.engine.test_model_vs_transformers import prompts

from .conftest import CHATML_TEMPLATE, SPECIAL_TOKENS, byte_level_vocab
from .test_gguf import llamacpp_permute

# our family -> llama.cpp's arch (Mixtral is written as llama with expert tensors)
GGUF_ARCH = {"qwen3": "qwen3", "mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
BLOCK = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
         "mlp.experts.down_proj": "ffn_down_exps.weight"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's state dict (transformers 5 holds the experts stacked) under llama.cpp's names."""
    c = model.config
    out = {}
    for name, tensor in model.state_dict().items():
        t = tensor.float()
        if name in TOP:
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            out[TOP[name]] = t
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            gate, up = t.chunk(2, dim=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
            continue
        if arch == "llama" and rest == "self_attn.q_proj.weight":
            t = llamacpp_permute(t, c.num_attention_heads)
        elif arch == "llama" and rest == "self_attn.k_proj.weight":
            t = llamacpp_permute(t, c.num_key_value_heads)
        out[f"blk.{layer}.{BLOCK[rest]}"] = t
    return {k: v.contiguous().numpy() for k, v in out.items()}


def write_family_gguf(path, model, family: str) -> None:
    import gguf

    c = model.config
    arch = GGUF_ARCH[family]
    tokens, merges = byte_level_vocab()
    # as many tokens as the model's vocabulary: the engine samples only ids its tokenizer knows
    tokens += [f"<extra_{i}>" for i in range(c.vocab_size - len(tokens))]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {family}")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if getattr(c, "head_dim", None):
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if family != "qwen3":
        writer.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
    if family == "qwen3_moe":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(SPECIAL_TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(SPECIAL_TOKENS.index("<|im_end|>"))
    writer.add_chat_template(CHATML_TEMPLATE)
    for name, array in gguf_tensors(model, arch).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """family -> (transformers model, GGUF path)."""
    out = {}
    for family in GGUF_ARCH:
        model = build_hf_model(family)
        if family == "olmoe":  # GGUF has no clip_qkv (llama.cpp's olmoe does not clip)
            model.config.clip_qkv = None
        path = tmp_path_factory.mktemp(f"gguf-{family}") / f"{family}.gguf"
        write_family_gguf(path, model, family)
        out[family] = (model, str(path))
    return out


@pytest.mark.parametrize("family", list(GGUF_ARCH))
def test_gguf_config_and_weights(gguf_models, family):
    model, path = gguf_models[family]
    source = load_model_source(path)
    c = source.config
    assert c.architecture == family
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (3, 64, 4, 2)
    assert c.qk_norm == {"qwen3": "head", "qwen3_moe": "head", "olmoe": "proj"}.get(family, "none")
    expected_moe = {"mixtral": (4, 2, 96, True, (0, 1, 2)), "qwen3_moe": (8, 3, 32, True, (0, 2)),
                    "olmoe": (6, 2, 96, False, (0, 1, 2))}.get(family)
    m = c.moe
    got = None if m is None else (m.num_experts, m.top_k, m.intermediate_size, m.renormalize, m.layers)
    assert got == expected_moe
    state = model.state_dict()
    loaded = dict(source.iter_weights())
    for name, tensor in loaded.items():
        parts = name.split(".")
        if len(parts) == 8 and parts[4] == "experts":  # model.layers.L.mlp.experts.E.proj.weight
            prefix, e, proj = ".".join(parts[:5]), int(parts[5]), parts[6]
            if proj == "down_proj":
                ref = state[prefix + ".down_proj"][e]
            else:
                ref = state[prefix + ".gate_up_proj"][e].chunk(2, dim=0)[proj == "up_proj"]
        else:
            ref = state[name]
        assert torch.equal(tensor, ref.float()), name
    # a sparse layer's two stacked tensors are 3 E weights here
    sparse = len(c.moe.layers) * (3 * c.moe.num_experts - 2) if c.moe else 0
    assert len(loaded) == len(state) - c.tie_word_embeddings + sparse


@pytest.mark.parametrize("family", list(GGUF_ARCH))
def test_gguf_greedy_tokens_equal_transformers_generate(gguf_models, family):
    model, path = gguf_models[family]
    llm = LLM(path, dtype="float32", device="cpu", num_blocks=64, max_num_batched_tokens=13)
    batch = prompts(2, seed=8)
    outs = llm.generate(batch, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_generate(model, prompt, 12)


def test_stacked_experts_of_the_wrong_shape_name_the_tensor(gguf_models, tmp_path):
    import gguf

    model, good = gguf_models["qwen3_moe"]
    reader = gguf.GGUFReader(good)
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             sub_type=field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if tensor.name == "blk.2.ffn_up_exps.weight":
            data = data[:, :16]  # [E, I / 2, H]
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as info:
        load_model_source(str(path))
    message = str(info.value)
    assert "blk.2.ffn_up_exps.weight" in message and "(8, 16, 64)" in message and "(8, 32, 64)" in message
