"""GGUF checkpoints (llama.cpp): metadata -> ModelConfig, tensors -> HF names, dequantized.

llama.cpp's HF->GGUF converter reorders the rows of q_proj and k_proj for arch `llama`
(it turns HF's half-split rotary layout into interleaved pairs, per head); `unpermute_qk`
undoes that. Arch `qwen2` is stored unpermuted. GGUF lists dimensions innermost first; the
reader's numpy arrays are already in torch order (out_features, in_features).

Llama 3 rope scaling is stored as a `rope_freqs.weight` tensor of per-frequency divisors
rather than as metadata; `_llama3_scaling_from_freqs` recovers the scaling parameters and
checks that they reproduce the tensor.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pdserve.config import ModelConfig, RopeScaling
from pdserve.loaders.source import ModelSource
from pdserve.loaders.layout import check_weight_shapes
from pdserve.tokenizer import load_gguf_tokenizer

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama", "qwen2")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
ROPE_FREQS = "rope_freqs.weight"
# Llama 3.1 / 3.2 values; GGUF keeps only the resulting rope_freqs tensor.
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192


def hf_name(name: str) -> str | None:
    """The HF Llama name of a GGUF tensor name, or None if it is not a model weight we know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.match(name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    return None


_HF_TO_GGUF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}
_HF_TO_GGUF_BLOCK = {v: k for k, v in _BLOCK_NAMES.items()}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def gguf_name(hf: str) -> str:
    """The GGUF name of an HF Llama weight name (inverse of `hf_name`); unknown names pass through."""
    if hf in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf]
    match = _HF_LAYER_RE.match(hf)
    if match and match.group(2) in _HF_TO_GGUF_BLOCK:
        return f"blk.{match.group(1)}.{_HF_TO_GGUF_BLOCK[match.group(2)]}"
    return hf


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k row permutation.

    Per head, GGUF stores rows in the order (0, d/2, 1, d/2+1, ...) of HF's rows, i.e. a
    (head, d/2, 2) layout; HF wants (head, 2, d/2). Works for weights and biases.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class _Metadata:
    """Typed access to GGUF key-value metadata, naming the file in errors."""

    def __init__(self, reader: Any, path: str) -> None:
        self._fields = reader.fields
        self._path = path

    def has(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        field = self._fields.get(key)
        if field is None:
            if required:
                raise ValueError(f"{self._path}: missing GGUF metadata key {key!r}")
            return default
        try:
            value = field.contents()
        except Exception as exc:
            raise ValueError(f"{self._path}: unreadable GGUF metadata key {key!r} ({exc})") from exc
        return value

    def int(self, key: str, default: Any = None, required: bool = False) -> Any:
        value = self.get(key, default, required)
        if value is None:
            return None
        if isinstance(value, list) and len(set(value)) == 1:  # per-layer arrays with one value
            value = value[0]
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{self._path}: GGUF metadata key {key!r} must be an integer, got {value!r}") from None


@functools.lru_cache(maxsize=1)
def _plain_reader_class() -> Any:
    """`gguf.GGUFReader` reading through a plain ndarray view of its memory map: the same fields
    and tensors (views of the same mapped file), but slicing an ndarray skips numpy's memmap
    bookkeeping, which the reader pays for each of the ~200,000 parts of a vocabulary (the
    figures: docs/usage.md, "The tokenizer cache"). Made once, on first use (gguf is imported
    lazily)."""
    from gguf import GGUFReader

    class PlainGGUFReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            dt = np.dtype(dtype)
            arr = plain[offset:offset + dt.itemsize * count].view(dtype=dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return PlainGGUFReader


def _open_reader(path: str) -> Any:
    from gguf import GGUFReader

    try:
        try:
            reader = _plain_reader_class()(path)
        except Exception:  # whatever it is, the library's own reader says it (or reads what we could not)
            reader = GGUFReader(path)
    except Exception as exc:  # bad magic, unsupported version, truncated header
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: not a valid GGUF file ({detail})") from exc
    for tensor in reader.tensors:
        if tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(f"{path}: truncated GGUF file (tensor {tensor.name} is incomplete)")
    return reader


def _dequantize(tensor: Any) -> torch.Tensor:
    """A GGUF tensor as a float32 torch tensor in numpy (= torch) dimension order."""
    from gguf.quants import dequantize

    array = dequantize(tensor.data, tensor.tensor_type)
    if not array.flags.writeable:  # F32 comes back as a view of the read-only memmap
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array))


def load_gguf(path: str) -> ModelSource:
    path = os.path.abspath(path)
    reader = _open_reader(path)
    meta = _Metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_gguf(meta, tensors, path)

    hf_names: dict[str, str] = {}  # gguf name -> HF name
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in tensors.items():
        if name == ROPE_FREQS:
            continue
        target = hf_name(name)
        if target is None:
            raise ValueError(f"{path}: unsupported tensor {name}")
        hf_names[name] = target
        shapes[target] = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    check_weight_shapes(shapes, config, path, gguf_name)

    tokenizer = load_gguf_tokenizer(path, config.eos_token_ids)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {config.vocab_size}"
        )
    permute = meta.get("general.architecture") == "llama"

    def iter_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, target in hf_names.items():
            tensor = tensors[name]
            weight = _dequantize(tensor).reshape(shapes[target])
            if permute and (".attn_q." in name or ".attn_k." in name):
                heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
                weight = unpermute_qk(weight, heads).contiguous()
            yield target, weight

    counts = Counter(t.tensor_type.name for t in reader.tensors)
    types = "/".join(name for name, _ in counts.most_common())
    return ModelSource(
        config=config,
        tokenizer=tokenizer,
        description=f"gguf:{path} ({types} dequantized)",
        weights_factory=iter_weights,
    )


def config_from_gguf(meta: _Metadata, tensors: dict[str, Any], path: str) -> ModelConfig:
    arch = meta.get("general.architecture", required=True)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    general_name = str(meta.get("general.name", "") or "")
    # llama.cpp writes Mistral as arch llama; the name is the only hint left.
    architecture = "mistral" if arch == "llama" and "mistral" in general_name.lower() else arch

    hidden = meta.int(f"{arch}.embedding_length", required=True)
    num_heads = meta.int(f"{arch}.attention.head_count", required=True)
    num_kv_heads = meta.int(f"{arch}.attention.head_count_kv", num_heads)
    if num_heads <= 0:
        raise ValueError(f"{path}: {arch}.attention.head_count must be positive, got {num_heads}")
    head_dim = meta.int(f"{arch}.attention.key_length")
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(f"{path}: embedding_length {hidden} is not divisible by head_count {num_heads}")
        head_dim = hidden // num_heads
    vocab = meta.int(f"{arch}.vocab_size")
    if vocab is None and meta.has("tokenizer.ggml.tokens"):
        vocab = len(meta._fields["tokenizer.ggml.tokens"].data)
    if vocab is None and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    if vocab is None:
        raise ValueError(f"{path}: cannot tell the vocabulary size (no {arch}.vocab_size, tokens or token_embd)")
    rope_theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))

    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if ROPE_FREQS in tensors:
        if arch != "llama":
            raise ValueError(f"{path}: rope_freqs tensor is only supported for arch llama")
        rope_scaling = _llama3_scaling_from_freqs(tensors[ROPE_FREQS], meta, arch, head_dim, rope_theta, path)
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{path}: unsupported rope_scaling type {scaling_type!r} (supported: llama3)")

    eos_ids = [meta.int(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id") if meta.has(k)]
    try:
        return ModelConfig(
            architecture=architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=meta.int(f"{arch}.feed_forward_length", required=True),
            num_layers=meta.int(f"{arch}.block_count", required=True),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=meta.int(f"{arch}.context_length", required=True),
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=meta.int("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            name=general_name or os.path.basename(path),
        )
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def llama3_rope_divisors(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Per-frequency divisors of the llama3 rope scaling (what GGUF stores as rope_freqs)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = 1.0 / ((1.0 - smooth) / scaling.factor + smooth)
    divisors = torch.where(wavelen < high_wavelen, torch.ones_like(wavelen), blended)
    return torch.where(wavelen > low_wavelen, torch.full_like(wavelen, scaling.factor), divisors)


def _llama3_scaling_from_freqs(
    tensor: Any, meta: _Metadata, arch: str, head_dim: int, theta: float, path: str
) -> RopeScaling:
    stored = _dequantize(tensor).double().flatten()
    if stored.numel() != head_dim // 2:
        raise ValueError(f"{path}: rope_freqs has {stored.numel()} values, expected {head_dim // 2}")
    scaling = RopeScaling(
        factor=float(meta.get(f"{arch}.rope.scaling.factor", stored.max().item())),
        low_freq_factor=_LLAMA3_LOW_FREQ_FACTOR,
        high_freq_factor=_LLAMA3_HIGH_FREQ_FACTOR,
        original_max_position_embeddings=meta.int(
            f"{arch}.rope.scaling.original_context_length", _LLAMA3_ORIGINAL_CONTEXT
        ),
    )
    expected = llama3_rope_divisors(head_dim, theta, scaling)
    if not torch.allclose(stored, expected, rtol=1e-4, atol=1e-4):
        raise ValueError(f"{path}: rope_freqs does not match llama3 rope scaling with factor {scaling.factor}")
    return scaling
