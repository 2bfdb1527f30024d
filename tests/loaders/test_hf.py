"""Hugging Face directories: tiny transformers models saved with save_pretrained, loaded back."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from pdserve.config import RopeScaling
from pdserve.loaders import load_model_source

from .conftest import CHATML_TEMPLATE, save_tiny_hf_tokenizer

VOCAB = 300
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _save_model(directory, model_cls, config, max_shard_size=None, generation_eos=None):
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms default to ones, biases to zeros: make every tensor distinct
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    save_tiny_hf_tokenizer(str(directory))
    if generation_eos is not None:
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": generation_eos}, f)
    return model.state_dict()


def _assert_same_weights(source, state_dict, tied):
    loaded = dict(source.iter_weights())
    expected = {k: v for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name
    if tied:
        assert "lm_head.weight" not in loaded
        assert torch.equal(state_dict["lm_head.weight"], loaded["model.embed_tokens.weight"])


def test_llama_single_file(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    state = _save_model(tmp_path, LlamaForCausalLM, LlamaConfig(**SMALL, rope_theta=20000.0, rms_norm_eps=1e-5,
                                                                  bos_token_id=1, eos_token_id=2))
    assert os.path.exists(tmp_path / "model.safetensors")
    source = load_model_source(str(tmp_path))
    c = source.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size,
            c.num_layers) == ("llama", VOCAB, 64, 96, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.max_position_embeddings) == (4, 2, 16, 256)
    assert c.rope_theta == 20000.0 and c.rms_norm_eps == 1e-5 and c.rope_scaling is None
    assert not c.tie_word_embeddings and not c.attention_bias
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert source.description.startswith(f"hf:{tmp_path}")
    _assert_same_weights(source, state, tied=False)


def test_llama_tied_llama3_rope_sharded(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    config = LlamaConfig(**SMALL, tie_word_embeddings=True, rope_scaling=rope, rope_theta=500000.0,
                         head_dim=32, eos_token_id=[2, 3])
    state = _save_model(tmp_path, LlamaForCausalLM, config, max_shard_size="40KB", generation_eos=[3, 1])
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
    source = load_model_source(str(tmp_path))
    c = source.config
    assert c.tie_word_embeddings and c.head_dim == 32
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=64)
    assert c.eos_token_ids == (2, 3, 1)  # config first, then generation_config.json
    assert source.tokenizer.eos_token_ids == (2, 3, 1)
    _assert_same_weights(source, state, tied=True)


def test_qwen2_biases(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    state = _save_model(tmp_path, Qwen2ForCausalLM, Qwen2Config(**SMALL, rope_theta=1e6))
    source = load_model_source(str(tmp_path))
    assert source.config.architecture == "qwen2" and source.config.attention_bias
    assert source.config.rope_theta == 1e6
    assert "model.layers.1.self_attn.k_proj.bias" in dict(source.iter_weights())
    _assert_same_weights(source, state, tied=False)


def test_mistral_sliding_window_warns(tmp_path, caplog):
    from transformers import MistralConfig, MistralForCausalLM

    state = _save_model(tmp_path, MistralForCausalLM, MistralConfig(**SMALL, sliding_window=128))
    with caplog.at_level(logging.WARNING, logger="pdserve.loaders.hf"):
        source = load_model_source(str(tmp_path))
    assert source.config.architecture == "mistral"
    assert any("sliding_window" in r.getMessage() for r in caplog.records)
    _assert_same_weights(source, state, tied=False)


def test_transformers4_style_config(tmp_path):
    """config.json as transformers 4.x wrote it: rope_theta and rope_scaling at top level."""
    from transformers import LlamaConfig, LlamaForCausalLM

    state = _save_model(tmp_path, LlamaForCausalLM, LlamaConfig(**SMALL))
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw.pop("rope_parameters", None)
    raw.pop("head_dim", None)
    raw["rope_theta"] = 123456.0
    raw["rope_scaling"] = {"type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                           "original_max_position_embeddings": 128}
    path.write_text(json.dumps(raw))
    source = load_model_source(str(tmp_path))
    assert source.config.rope_theta == 123456.0 and source.config.head_dim == 16
    assert source.config.rope_scaling.factor == 2.0
    _assert_same_weights(source, state, tied=False)


def test_tokenizer_and_chat_template_from_dir(tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _save_model(tmp_path, LlamaForCausalLM, LlamaConfig(**SMALL))
    tokenizer = load_model_source(str(tmp_path)).tokenizer
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "hello world, héllo 😀"
    assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.has_chat_template
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.chat_template == CHATML_TEMPLATE


def test_chat_template_jinja_file(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    _save_model(tmp_path, LlamaForCausalLM, LlamaConfig(**SMALL))
    config_path = tmp_path / "tokenizer_config.json"
    raw = json.loads(config_path.read_text())
    raw.pop("chat_template", None)
    config_path.write_text(json.dumps(raw))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tokenizer = load_model_source(str(tmp_path)).tokenizer
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint(tmp_path, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    _save_model(tmp_path, LlamaForCausalLM, LlamaConfig(**SMALL))
    model = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=dtype)
    model.save_pretrained(tmp_path)
    source = load_model_source(str(tmp_path))
    _assert_same_weights(source, model.state_dict(), tied=False)
