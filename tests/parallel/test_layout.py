"""TPLayout: what each rank holds; shards concatenate to the whole tensors; start-up checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.loaders import load_model_source
from pdserve.loaders.random_weights import RANDOM_SHAPES
from pdserve.parallel.layout import TPLayout, check_tensor_parallel

SMOL = RANDOM_SHAPES["smollm2-135m"]  # 9 heads, 3 KV heads


def test_smollm2_at_tp3_has_three_query_heads_and_one_kv_head_per_rank():
    for rank in range(3):
        layout = TPLayout(SMOL, rank, 3)
        assert (layout.num_heads, layout.num_kv_heads, layout.first_kv_head) == (3, 1, rank)
        assert layout.intermediate_size == 512 and layout.vocab_range == (rank * 16384, (rank + 1) * 16384)
        local = layout.local_config()
        assert (local.num_heads, local.num_kv_heads, local.vocab_size) == (3, 1, 49152)


def test_fewer_kv_heads_than_ranks_are_replicated():
    config = RANDOM_SHAPES["tiny-llama"]  # 4 heads, 2 KV heads: TP=4 puts each KV head on 2 ranks
    assert [(TPLayout(config, r, 4).num_kv_heads, TPLayout(config, r, 4).first_kv_head) for r in range(4)] == \
        [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert TPLayout(config, 0, 4).kv_replicas == 2
    mqa = RANDOM_SHAPES["tiny-qwen2-tp"]  # 1 KV head: every rank holds it
    assert {TPLayout(mqa, r, 3).first_kv_head for r in range(3)} == {0}


def test_size_one_keeps_every_tensor_whole():
    layout = TPLayout(SMOL)
    assert layout.local_config() is SMOL
    assert layout.shard_index("model.layers.0.self_attn.q_proj.weight") is None
    assert layout.shard_index("model.embed_tokens.weight") is None


@pytest.mark.parametrize("name, size", [(n, s) for n in ("tiny-llama-tp", "tiny-qwen2-tp", "tiny-mistral-tp")
                                         for s in (2, 3)] + [("tiny-llama", 2), ("tiny-llama", 4)])
def test_random_shards_concatenate_to_the_whole_tensors(name, size):
    config = RANDOM_SHAPES[name]
    source = load_model_source(f"random:{name}")
    whole = dict(source.iter_weights())
    shards = [dict(source.iter_weights(shard=TPLayout(config, r, size).shard_index)) for r in range(size)]
    d = config.head_dim
    for tensor_name, full in whole.items():
        parts = [s[tensor_name] for s in shards]
        if tensor_name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            kv = TPLayout(config, 0, size).num_kv_heads * d
            # each rank holds its own heads or (fewer KV heads than ranks) a replica
            unique = list({TPLayout(config, r, size).first_kv_head: p for r, p in enumerate(parts)}.values())
            assert all(p.shape[0] == kv for p in parts)
            assert torch.equal(torch.cat(unique), full)
        elif tensor_name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), full)
        elif "norm" in tensor_name:
            assert all(torch.equal(p, full) for p in parts)
        else:  # q, gate, up (rows), embedding and LM head (vocab rows; the last rank is short)
            assert torch.equal(torch.cat(parts), full)
            assert parts[0].shape[0] == -(-full.shape[0] // size)


def test_safetensors_shards_read_only_their_slice(hf_models):
    _, path = hf_models["llama"]  # 4 heads, 2 KV heads
    source = load_model_source(path)
    whole = dict(source.iter_weights())
    shards = [dict(source.iter_weights(shard=TPLayout(source.config, r, 2).shard_index)) for r in range(2)]
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([s[name] for s in shards], dim=1), whole[name])
    name = "model.layers.2.mlp.up_proj.weight"
    assert torch.equal(torch.cat([s[name] for s in shards]), whole[name])
    assert shards[1]["model.embed_tokens.weight"].shape[0] == source.config.vocab_size // 2


def test_gguf_shards_are_cut_after_dequantizing():
    source = load_model_source("smollm2")
    whole, shard = source.iter_weights(), source.iter_weights(shard=TPLayout(source.config, 2, 3).shard_index)
    for (name, full), (name2, part) in zip(whole, shard):
        assert name == name2
        if name.endswith("self_attn.k_proj.weight"):  # rank 2 holds KV head 2 (unpermuted rows)
            assert torch.equal(part, full[128:192])
            break
        if name.endswith("self_attn.q_proj.weight"):
            assert torch.equal(part, full[384:576])


@pytest.mark.parametrize("heads, kv_heads, size, message", [
    (9, 3, 0, "--tensor-parallel-size must be a positive integer, got 0"),
    (9, 3, 2, "--tensor-parallel-size 2 does not divide the 9 attention heads"),
    (12, 4, 6, "--tensor-parallel-size 6: the 4 KV heads of random:smollm2-135m neither divide by 6 nor divide it"),
])
def test_bad_sizes_name_the_flag(heads, kv_heads, size, message):
    config = dataclasses.replace(SMOL, num_heads=heads, num_kv_heads=kv_heads)
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config, size)


def test_more_ranks_than_gpus_and_mlp_width():
    check_tensor_parallel(SMOL, 3, device_type="cuda", num_gpus=4)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 needs 3 GPUs, this machine has 2"):
        check_tensor_parallel(SMOL, 3, device_type="cuda", num_gpus=2)
    with pytest.raises(ValueError, match="MLP width 1537"):
        check_tensor_parallel(dataclasses.replace(SMOL, intermediate_size=1537), 3)
