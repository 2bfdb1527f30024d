"""GGUF checkpoints (llama.cpp): metadata -> ModelConfig, tensors -> HF names, dequantized.

llama.cpp's HF->GGUF converter reorders the rows of q_proj and k_proj for arch `llama`
(it turns HF's half-split rotary layout into interleaved pairs, per head); `unpermute_qk`
undoes that. Archs `qwen2`, `qwen3`, `qwen3moe` and `olmoe` are stored unpermuted.

Mixture-of-experts files (`qwen3moe`, `olmoe`, and Mixtral as arch `llama` with expert
tensors) stack each layer's experts: `ffn_gate_exps` / `ffn_up_exps` [E, I, H] and
`ffn_down_exps` [E, H, I] (torch order), beside the router `ffn_gate_inp` [E, H]. They are
checked whole against the config and handed out one expert at a time under the per-expert HF
names (`loaders.layout`). Which layers are sparse is read from which have a router.

GGUF lists dimensions innermost first; the reader's numpy arrays are already in torch order
(out_features, in_features).

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

from pdserve.config import ModelConfig, MoEConfig, RopeScaling
from pdserve.loaders.source import ModelSource
from pdserve.loaders.layout import check_weight_shapes
from pdserve.tokenizer import load_gguf_tokenizer

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "olmoe")
# our architecture of a GGUF arch (llama: Mistral or Mixtral by the name or the experts)
_ARCHITECTURE = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
_QK_NORM = {"qwen3": "head", "qwen3moe": "head", "olmoe": "proj"}
# llama.cpp's fixed choice per arch when `{arch}.expert_weights_norm` is absent: whether the
# top-k routing weights are renormalized (llama: Mixtral)
_RENORMALIZE = {"llama": True, "qwen3moe": True, "olmoe": False}
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
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# stacked experts [E, rows, cols] -> the per-expert HF projection
_EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                   "ffn_down_exps.weight": "down_proj"}
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
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


def stacked_experts(name: str) -> tuple[int, str] | None:
    """(layer, HF projection) of a GGUF stacked expert tensor's name, else None."""
    match = _BLOCK_RE.match(name)
    if match and match.group(2) in _EXPERT_TENSORS:
        return int(match.group(1)), _EXPERT_TENSORS[match.group(2)]
    return None


def gguf_name(hf: str) -> str:
    """The GGUF name of an HF weight name (inverse of `hf_name`; an expert's weight: its stacked
    tensor); unknown names pass through."""
    if hf in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf]
    expert = _HF_EXPERT_RE.match(hf)
    if expert:
        stacked = {v: k for k, v in _EXPERT_TENSORS.items()}[expert.group(2)]
        return f"blk.{expert.group(1)}.{stacked}"
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

    hf_names: dict[str, str] = {}  # gguf name -> HF name (the per-expert names' prefix for stacked experts)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in tensors.items():
        if name == ROPE_FREQS:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        experts = stacked_experts(name)
        if experts is not None:
            hf_names[name] = _check_stacked(name, shape, experts, config, path)
            per_expert = shape[1:]
            for e in range(shape[0]):
                shapes[f"{hf_names[name]}.{e}.{experts[1]}.weight"] = per_expert
            continue
        target = hf_name(name)
        if target is None:
            raise ValueError(f"{path}: unsupported tensor {name}")
        hf_names[name] = target
        shapes[target] = shape
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
            experts = stacked_experts(name)
            if experts is not None:  # one dequantized stack, handed out an expert at a time
                stack = _dequantize(tensor).reshape(-1, *shapes[f"{target}.0.{experts[1]}.weight"])
                for e in range(stack.shape[0]):
                    yield f"{target}.{e}.{experts[1]}.weight", stack[e]
                continue
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


def _check_stacked(name: str, shape: tuple[int, ...], experts: tuple[int, str], config: ModelConfig,
                   path: str) -> str:
    """ValueError naming the stacked expert tensor `name` unless its shape is the config's; returns
    the HF prefix of its experts (`model.layers.<i>.mlp.experts`)."""
    layer, proj = experts
    moe = config.moe
    if moe is None or not config.is_moe_layer(layer):
        raise ValueError(f"{path}: unexpected tensor {name} (layer {layer} has no router ffn_gate_inp)")
    e, i, h = moe.num_experts, moe.intermediate_size, config.hidden_size
    expected = (e, h, i) if proj == "down_proj" else (e, i, h)
    if shape != expected:
        raise ValueError(f"{path}: tensor {name} has shape {shape}, expected {expected} from the model config "
                         f"({e} experts of width {i}, hidden size {h})")
    return f"model.layers.{layer}.mlp.experts"


def _moe_from_gguf(meta: _Metadata, tensors: dict[str, Any], arch: str, num_layers: int, ffn: int,
                   path: str) -> MoEConfig | None:
    """The sparse MLP of a GGUF file: expert counts from the metadata, the sparse layers from
    the routers present (None without experts)."""
    routers = sorted(int(m.group(1)) for m in map(_BLOCK_RE.match, tensors)
                     if m and m.group(2) == "ffn_gate_inp.weight")
    count = meta.int(f"{arch}.expert_count", 0)
    if not count:
        if routers or arch in ("qwen3moe", "olmoe"):
            raise ValueError(f"{path}: {arch} file without {arch}.expert_count")
        return None
    if not routers:
        raise ValueError(f"{path}: {arch}.expert_count is {count} but no layer has a router (ffn_gate_inp)")
    scale = meta.get(f"{arch}.expert_weights_scale")
    if scale is not None and float(scale) != 1.0:
        raise ValueError(f"{path}: {arch}.expert_weights_scale {scale} is not supported (only 1.0)")
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating is not None and int(gating) != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ValueError(f"{path}: {arch}.expert_gating_func {gating} is not supported (only softmax, 1)")
    renormalize = meta.get(f"{arch}.expert_weights_norm")
    try:
        return MoEConfig(num_experts=count, top_k=meta.int(f"{arch}.expert_used_count", required=True),
                         intermediate_size=meta.int(f"{arch}.expert_feed_forward_length", ffn),
                         renormalize=_RENORMALIZE[arch] if renormalize is None else bool(renormalize),
                         layers=tuple(routers))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def config_from_gguf(meta: _Metadata, tensors: dict[str, Any], path: str) -> ModelConfig:
    arch = meta.get("general.architecture", required=True)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    general_name = str(meta.get("general.name", "") or "")
    num_layers = meta.int(f"{arch}.block_count", required=True)
    ffn = meta.int(f"{arch}.feed_forward_length", required=True)
    moe = _moe_from_gguf(meta, tensors, arch, num_layers, ffn, path)
    # llama.cpp writes Mistral and Mixtral as arch llama; the name and the experts are the hints left.
    architecture = _ARCHITECTURE.get(arch, arch)
    if arch == "llama":
        architecture = "mixtral" if moe is not None else "mistral" if "mistral" in general_name.lower() else "llama"

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
            intermediate_size=ffn,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=meta.int(f"{arch}.context_length", required=True),
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm=_QK_NORM.get(arch, "none"),
            moe=moe,
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
