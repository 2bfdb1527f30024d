"""random:<name> specs: shapes, determinism, laziness."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.loaders import load_model_source
from pdserve.loaders.layout import expected_weight_shapes
from pdserve.loaders.random_weights import REAL_SHAPES, TINY_SHAPES, parse_random_spec


@pytest.mark.parametrize("name", sorted(TINY_SHAPES))
def test_tiny_shapes(name):
    source = load_model_source(f"random:{name}")
    assert source.tokenizer is None and "no tokenizer" in source.description
    c = source.config
    assert c.hidden_size == 64 and c.max_position_embeddings == 512 and 512 <= c.vocab_size <= 1000
    assert 2 <= c.num_layers <= 4 and c.num_heads > c.num_kv_heads
    weights = source.iter_weights()
    assert isinstance(weights, types.GeneratorType)
    loaded = dict(weights)
    assert {k: tuple(v.shape) for k, v in loaded.items()} == expected_weight_shapes(c)
    assert ("lm_head.weight" in loaded) == (not c.tie_word_embeddings)
    assert any(k.endswith("q_proj.bias") for k in loaded) == c.attention_bias
    norm = loaded["model.layers.0.input_layernorm.weight"]
    assert 0.9 < norm.mean().item() < 1.1 and norm.std().item() > 0.01
    embed = loaded["model.embed_tokens.weight"]
    assert abs(embed.std().item() - 0.02) < 0.002


def test_tiny_architectures():
    assert load_model_source("random:tiny-qwen2").config.attention_bias
    assert load_model_source("random:tiny-mistral").config.architecture == "mistral"
    assert load_model_source("random:tiny-tied").config.tie_word_embeddings


def test_seeded_and_deterministic():
    a = dict(load_model_source("random:tiny-llama").iter_weights())
    b = dict(load_model_source("random:tiny-llama?seed=0").iter_weights())
    c = dict(load_model_source("random:tiny-llama?seed=7").iter_weights())
    for name in a:
        assert torch.equal(a[name], b[name])
        assert not torch.equal(a[name], c[name])
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], a["model.layers.1.mlp.up_proj.weight"])


def test_real_shapes():
    c = REAL_SHAPES["llama-3.1-8b"]
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == \
        (128256, 4096, 32, 32, 8, 128)
    assert c.rope_theta == 500000.0 and c.rope_scaling.factor == 8.0 and not c.tie_word_embeddings
    q = REAL_SHAPES["qwen2.5-7b"]
    assert q.vocab_size == 152064 and q.attention_bias and q.num_kv_heads == 4
    assert REAL_SHAPES["llama-3.2-1b"].tie_word_embeddings
    total = sum(torch.Size(s).numel() for s in expected_weight_shapes(c).values())
    assert 8.0e9 < total < 8.1e9


def test_real_shape_uses_smollm2_tokenizer(smollm2_source):
    source = load_model_source("random:llama-3.1-8b?seed=1")
    assert source.tokenizer is smollm2_source.tokenizer or source.tokenizer.vocab_size == 49152
    assert source.config.eos_token_ids == (2,) and "SmolLM2 tokenizer" in source.description
    assert "seed 1" in source.description
    small = load_model_source("random:smollm2-135m")
    weights = small.iter_weights()
    name, first = next(weights)  # lazy: only the first tensor exists now
    assert name == "model.embed_tokens.weight" and first.shape == (49152, 576)


def test_parse_spec():
    assert parse_random_spec("random:tiny-llama") == ("tiny-llama", 0)
    assert parse_random_spec("random:tiny-llama?seed=42") == ("tiny-llama", 42)
