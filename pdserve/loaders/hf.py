"""Hugging Face model directories: config.json, safetensors (single or sharded), tokenizer.

Reads configs written by transformers 4.x (`rope_theta`, `rope_scaling`) and 5.x
(`rope_parameters` holding both). Weights are read lazily, one tensor at a time.

Expert weights come in two layouts, both read into the per-expert names of `loaders.layout`:
per expert (`mlp.experts.<e>.{gate,up,down}_proj.weight`; Mixtral's
`block_sparse_moe.experts.<e>.w1/w3/w2.weight`, w1 the gate and w3 the up projection), or stacked
as transformers 5 holds them in memory (`mlp.experts.gate_up_proj` [E, 2I, H], each expert's gate
rows then its up rows, and `mlp.experts.down_proj` [E, H, I]). A stacked tensor is read one expert
(and, under tensor parallelism, one slice) at a time.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import ModelConfig, MoEConfig, RopeScaling
from pdserve.loaders.source import ModelSource
from pdserve.loaders.layout import check_weight_shapes
from pdserve.tokenizer import load_hf_tokenizer

logger = logging.getLogger(__name__)

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "qwen3": "qwen3", "mixtral": "mixtral",
                  "qwen3_moe": "qwen3_moe", "olmoe": "olmoe"}
# q/k RMSNorm before RoPE: per head (Qwen3, Qwen3-MoE) or over the whole projection (OLMoE)
_QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "proj"}
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
                for name, read in names_by_file[path]:
                    index = read.index(None if shard is None else shard(name))
                    if index is None:
                        yield name, handle.get_tensor(read.name)
                    else:  # a stacked expert, or tensor parallelism: read only this slice
                        tensor = handle.get_slice(read.name)[index]
                        yield name, tensor[0] if read.expert is not None else tensor

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
    if architecture in ("mixtral", "qwen3", "qwen3_moe") and get("sliding_window") is not None \
            and get("use_sliding_window", architecture == "mixtral"):
        logger.warning("%s: sliding_window is ignored; attention is full", where)
    if architecture == "qwen2" and get("use_sliding_window", False):
        logger.warning("%s: use_sliding_window is ignored; attention is full", where)
    num_layers = _int(get("num_hidden_layers", required=True), "num_hidden_layers", where)
    intermediate = _int(get("intermediate_size", required=True), "intermediate_size", where)
    moe = _moe(raw, architecture, num_layers, intermediate, where)
    clip_qkv = get("clip_qkv") if architecture == "olmoe" else None
    if clip_qkv is not None and (isinstance(clip_qkv, bool) or not isinstance(clip_qkv, (int, float))
                                 or clip_qkv <= 0):
        raise ValueError(f"{where}: clip_qkv must be a positive number or null, got {clip_qkv!r}")

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
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=_int(head_dim, "head_dim", where),
            max_position_embeddings=max_positions,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=architecture == "qwen2" or bool(get("attention_bias", False)),
            qk_norm=_QK_NORM.get(architecture, "none"),
            clip_qkv=None if clip_qkv is None else float(clip_qkv),
            moe=moe,
            bos_token_id=None if bos is None else _int(bos, "bos_token_id", where, allow_zero=True),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            name=str(get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(where)))),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc


# transformers' defaults for the MoE keys a config.json may leave out (their config classes')
_MOE_DEFAULTS = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False},
}


def _moe(raw: dict[str, Any], architecture: str, num_layers: int, intermediate: int, where: str) -> MoEConfig | None:
    """The sparse MLP of a mixture-of-experts config.json (None for a dense family)."""
    if architecture not in _MOE_DEFAULTS:
        return None
    defaults = _MOE_DEFAULTS[architecture]

    def get(key: str) -> Any:
        value = raw.get(key)
        return defaults[key] if value is None else value

    # transformers 5 writes num_local_experts for every family (an alias of num_experts)
    key = next((k for k in ("num_experts", "num_local_experts") if raw.get(k) is not None),
               "num_local_experts" if architecture == "mixtral" else "num_experts")
    num_experts = _int(raw.get(key, defaults.get(key)), key, where, allow_zero=architecture == "qwen3_moe")
    if architecture == "mixtral":
        width, renormalize, layers = intermediate, True, tuple(range(num_layers))
    else:
        renormalize = get("norm_topk_prob")
        if not isinstance(renormalize, bool):
            raise ValueError(f"{where}: norm_topk_prob must be true or false, got {renormalize!r}")
        width, layers = intermediate, tuple(range(num_layers))
        if architecture == "qwen3_moe":
            width = _int(get("moe_intermediate_size"), "moe_intermediate_size", where)
            step = _int(get("decoder_sparse_step"), "decoder_sparse_step", where)
            dense = get("mlp_only_layers")
            if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
                raise ValueError(f"{where}: mlp_only_layers must be a list of layer indices, got {dense!r}")
            # as transformers' Qwen3MoeDecoderLayer chooses
            layers = tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
            if not layers:
                return None  # every layer dense
    top_k = _int(get("num_experts_per_tok"), "num_experts_per_tok", where)
    try:
        return MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=width, renormalize=renormalize,
                         layers=layers)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


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


@dataclass(frozen=True)
class _Read:
    """Where one weight (under its `loaders.layout` name) lies in a file: the whole tensor `name`,
    or, of a stacked expert tensor [E, R, C], expert `expert`'s rows [row_start, row_start + rows)."""

    name: str
    expert: int | None = None
    row_start: int = 0
    rows: int = 0

    def index(self, shard: tuple[slice, ...] | None) -> tuple[slice, ...] | None:
        """The file tensor's index of the weight's slice `shard` (None: the whole weight)."""
        if self.expert is None:
            return shard
        rows, *rest = shard if shard is not None else (slice(None),)
        start, stop, step = rows.indices(self.rows)
        if step != 1:
            raise AssertionError("weight slices are contiguous")
        return (slice(self.expert, self.expert + 1), slice(self.row_start + start, self.row_start + stop),
                *(rest or [slice(None)]))


# Mixtral's names for the experts and the router, and the stacked (fused) expert tensors
_MIXTRAL_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")


def _layout_name(name: str) -> str:
    """A per-tensor name of the file as `loaders.layout` names it (Mixtral's renamed)."""
    match = _MIXTRAL_EXPERT.match(name)
    if match:
        return f"{match.group(1)}.mlp.experts.{match.group(2)}.{_MIXTRAL_PROJ[match.group(3)]}.weight"
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


def _file_name(name: str, architecture: str) -> str:
    """The name a checkpoint of `architecture` gives the layout's weight `name` (for messages)."""
    if architecture != "mixtral":
        return name
    for short, proj in _MIXTRAL_PROJ.items():
        name = re.sub(rf"\.mlp\.experts\.(\d+)\.{proj}\.", rf".block_sparse_moe.experts.\1.{short}.", name)
    return name.replace(".mlp.gate.", ".block_sparse_moe.gate.")


def _reads(name: str, shape: tuple[int, ...], config: ModelConfig, path: str) -> list[tuple[str, _Read, tuple]]:
    """The weights one file tensor holds: [(layout name, read, shape)]; a stacked expert tensor
    holds one (two: gate and up) per expert, and is checked against the config here."""
    match = _STACKED.match(name)
    if match is None:
        return [(_layout_name(name), _Read(name), shape)]
    layer, kind = int(match.group(1)), match.group(2)
    moe = config.moe
    if moe is None or not config.is_moe_layer(layer):
        raise ValueError(f"{path}: unexpected tensor {name} (layer {layer} of the model config has a dense MLP)")
    e, i, h = moe.num_experts, moe.intermediate_size, config.hidden_size
    expected = (e, 2 * i, h) if kind == "gate_up_proj" else (e, h, i)
    if shape != expected:
        raise ValueError(f"{path}: tensor {name} has shape {shape}, expected {expected} from the model config "
                         f"({e} experts of width {i}, hidden size {h})")
    prefix = f"model.layers.{layer}.mlp.experts."
    if kind == "down_proj":
        return [(f"{prefix}{x}.down_proj.weight", _Read(name, x, 0, h), (h, i)) for x in range(e)]
    return [(f"{prefix}{x}.{proj}.weight", _Read(name, x, start, i), (i, h))
            for x in range(e) for proj, start in (("gate_proj", 0), ("up_proj", i))]


def _index_weights(model_dir: str, config: ModelConfig) -> tuple[list[str], dict[str, list[tuple[str, _Read]]],
                                                                  set[str]]:
    """The safetensors files in load order, the weights each holds (layout name and where it
    lies), and their dtypes; checks names and shapes against the config."""
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
    names_by_file: dict[str, list[tuple[str, _Read]]] = {}
    dtypes: set[str] = set()
    for path in files:
        names: list[tuple[str, _Read]] = []
        try:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        logger.debug("%s: skipping lm_head.weight, embeddings are tied", path)
                        continue
                    tensor_slice = handle.get_slice(name)
                    dtype = tensor_slice.get_dtype()
                    if dtype not in FLOAT_DTYPES:
                        raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype} "
                                         "(quantized checkpoints are not supported)")
                    dtypes.add(dtype)
                    for weight, read, shape in _reads(name, tuple(tensor_slice.get_shape()), config, path):
                        if weight in shapes:
                            raise ValueError(f"{path}: tensor {_file_name(weight, config.architecture)} appears "
                                             "more than once (in more than one file, or both per expert and stacked)")
                        shapes[weight] = shape
                        names.append((weight, read))
        except SafetensorError as exc:
            raise ValueError(f"{path}: not a valid safetensors file ({exc})") from exc
        except OSError as exc:
            raise ValueError(f"{path}: cannot read ({exc})") from exc
        names_by_file[path] = names
    check_weight_shapes(shapes, config, model_dir, lambda name: _file_name(name, config.architecture))
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
