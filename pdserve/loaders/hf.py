"""Hugging Face model directories: config.json, safetensors (single or sharded), tokenizer.

Reads configs written by transformers 4.x (`rope_theta`, `rope_scaling`) and 5.x
(`rope_parameters` holding both). Weights are read lazily, one tensor at a time.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from pdserve.config import ModelConfig, RopeScaling
from pdserve.loaders.source import ModelSource
from pdserve.loaders.layout import check_weight_shapes
from pdserve.tokenizer import load_hf_tokenizer

logger = logging.getLogger(__name__)

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
# Buffers some old checkpoints saved; recomputed by the engine.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_hf_dir(model_dir: str) -> ModelSource:
    model_dir = os.path.abspath(model_dir)
    config_path = os.path.join(model_dir, "config.json")
    raw = _read_json(config_path, required=True)
    generation = _read_json(os.path.join(model_dir, "generation_config.json"), required=False) or {}
    config = config_from_hf_dict(raw, config_path, generation)
    files, names_by_file, dtypes = _index_weights(model_dir, config)
    tokenizer = None
    if any(os.path.exists(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        tokenizer = load_hf_tokenizer(model_dir, config.eos_token_ids)
    else:
        logger.warning("%s: no tokenizer files; the model takes token ids only", model_dir)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{model_dir}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{config.vocab_size}"
        )

    def iter_weights(shard=None) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for path in files:
            with safe_open(path, framework="pt") as handle:
                for name in names_by_file[path]:
                    index = None if shard is None else shard(name)
                    if index is None:
                        yield name, handle.get_tensor(name)
                    else:  # tensor parallelism: read only this rank's slice
                        yield name, handle.get_slice(name)[index]

    dtype_text = "/".join(sorted(dtypes))
    return ModelSource(
        config=config,
        tokenizer=tokenizer,
        description=f"hf:{model_dir} ({config.architecture}, {len(files)} safetensors file(s), {dtype_text})",
        weights_factory=iter_weights,
        shard_aware=True,
    )


def config_from_hf_dict(raw: dict[str, Any], where: str, generation: dict[str, Any] | None = None) -> ModelConfig:
    """A `ModelConfig` from a config.json dict; ValueError naming `where` and the key on bad input."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object")
    architecture = _architecture(raw, where)

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = raw.get(key, default)
        if value is None and required:
            raise ValueError(f"{where}: missing key {key!r}")
        return value

    hidden_act = get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"{where}: unsupported hidden_act {hidden_act!r} (only silu)")
    if get("mlp_bias", False):
        raise ValueError(f"{where}: mlp_bias is not supported")

    hidden_size = _int(get("hidden_size", required=True), "hidden_size", where)
    num_heads = _int(get("num_attention_heads", required=True), "num_attention_heads", where)
    num_kv_heads = _int(get("num_key_value_heads", num_heads), "num_key_value_heads", where)
    head_dim = get("head_dim")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"{where}: hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads}")
        head_dim = hidden_size // num_heads
    max_positions = _int(get("max_position_embeddings", required=True), "max_position_embeddings", where)
    rope_theta, rope_scaling = _rope(raw, where)

    if architecture == "mistral" and get("sliding_window") is not None:
        window = _int(get("sliding_window"), "sliding_window", where)
        if window < max_positions:
            logger.warning(
                "%s: sliding_window %d < max_position_embeddings %d is ignored; attention is full, "
                "so outputs past %d tokens differ from the reference model",
                where, window, max_positions, window,
            )
    if architecture == "qwen2" and get("use_sliding_window", False):
        logger.warning("%s: use_sliding_window is ignored; attention is full", where)

    eos_ids = _token_ids(get("eos_token_id"), "eos_token_id", where)
    if generation:
        eos_ids += _token_ids(generation.get("eos_token_id"), "eos_token_id", where + " (generation_config.json)")
    bos = get("bos_token_id")
    if bos is None and generation:
        bos = generation.get("bos_token_id")
    try:
        return ModelConfig(
            architecture=architecture,
            vocab_size=_int(get("vocab_size", required=True), "vocab_size", where),
            hidden_size=hidden_size,
            intermediate_size=_int(get("intermediate_size", required=True), "intermediate_size", where),
            num_layers=_int(get("num_hidden_layers", required=True), "num_hidden_layers", where),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=_int(head_dim, "head_dim", where),
            max_position_embeddings=max_positions,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=architecture == "qwen2" or bool(get("attention_bias", False)),
            bos_token_id=None if bos is None else _int(bos, "bos_token_id", where, allow_zero=True),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            name=str(get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(where)))),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc


def _architecture(raw: dict[str, Any], where: str) -> str:
    architectures = raw.get("architectures")
    if architectures:
        if not isinstance(architectures, list):
            raise ValueError(f"{where}: 'architectures' must be a list")
        for name in architectures:
            if name in HF_ARCHITECTURES:
                return HF_ARCHITECTURES[name]
        raise ValueError(
            f"{where}: unsupported architecture {', '.join(map(str, architectures))}; "
            f"supported: {', '.join(HF_ARCHITECTURES)}"
        )
    model_type = raw.get("model_type")
    if model_type in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[model_type]
    raise ValueError(f"{where}: unsupported model_type {model_type!r}; supported: {', '.join(HF_MODEL_TYPES)}")


def _rope(raw: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{where}: 'rope_parameters' must be an object")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{where}: per-layer-type rope_parameters are not supported")
    scaling = dict(params or {})
    legacy = raw.get("rope_scaling")
    if legacy is not None:
        if not isinstance(legacy, dict):
            raise ValueError(f"{where}: 'rope_scaling' must be an object or null")
        scaling = {**legacy, **scaling}
    theta = scaling.get("rope_theta", raw.get("rope_theta", 10000.0))
    try:
        theta = float(theta)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: rope_theta must be a number, got {theta!r}") from None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"{where}: unsupported rope_scaling type {rope_type!r} (supported: llama3)")
    values: dict[str, Any] = {}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            raise ValueError(f"{where}: rope_scaling of type llama3 is missing {key!r}")
        values[key] = scaling[key]
    return theta, RopeScaling(
        factor=float(values["factor"]),
        low_freq_factor=float(values["low_freq_factor"]),
        high_freq_factor=float(values["high_freq_factor"]),
        original_max_position_embeddings=_int(
            values["original_max_position_embeddings"], "original_max_position_embeddings", where
        ),
    )


def _index_weights(model_dir: str, config: ModelConfig) -> tuple[list[str], dict[str, list[str]], set[str]]:
    """The safetensors files in load order, the HF names each holds, and their dtypes; checks
    names and shapes against the config."""
    from safetensors import SafetensorError, safe_open

    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index_path):
        index = _read_json(index_path, required=True)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: missing or empty 'weight_map'")
        files = [os.path.join(model_dir, f) for f in dict.fromkeys(weight_map.values())]
        for path in files:
            if not os.path.isfile(path):
                raise ValueError(f"{index_path}: shard {os.path.basename(path)} not found")
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            found = [n for n in ("pytorch_model.bin", "model.pt") if os.path.exists(os.path.join(model_dir, n))]
            extra = f" (found {found[0]}; only safetensors is supported)" if found else ""
            raise ValueError(f"{model_dir}: no *.safetensors weights{extra}")

    shapes: dict[str, tuple[int, ...]] = {}
    names_by_file: dict[str, list[str]] = {}
    dtypes: set[str] = set()
    for path in files:
        names: list[str] = []
        try:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        logger.debug("%s: skipping lm_head.weight, embeddings are tied", path)
                        continue
                    if name in shapes:
                        raise ValueError(f"{path}: tensor {name} appears in more than one file")
                    tensor_slice = handle.get_slice(name)
                    dtype = tensor_slice.get_dtype()
                    if dtype not in FLOAT_DTYPES:
                        raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype} (quantized checkpoints are not supported)")
                    dtypes.add(dtype)
                    shapes[name] = tuple(tensor_slice.get_shape())
                    names.append(name)
        except SafetensorError as exc:
            raise ValueError(f"{path}: not a valid safetensors file ({exc})") from exc
        except OSError as exc:
            raise ValueError(f"{path}: cannot read ({exc})") from exc
        names_by_file[path] = names
    check_weight_shapes(shapes, config, model_dir)
    return files, names_by_file, dtypes


def _read_json(path: str, required: bool) -> Any:
    if not os.path.exists(path):
        if required:
            raise ValueError(f"{path}: file not found")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: malformed JSON ({exc})") from exc


def _int(value: Any, key: str, where: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _token_ids(value: Any, key: str, where: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    return [_int(v, key, where, allow_zero=True) for v in items]
