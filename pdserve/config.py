"""Frozen configuration dataclasses, composed into each other.

`ModelConfig` describes the shape of a decoder model (the Llama family, Qwen3, and the
mixture-of-experts families, whose sparse MLP is a `MoEConfig`), whatever it was loaded from.
`CacheConfig`, `SchedulerConfig`, `KernelConfig` and `EngineConfig` describe how the engine
runs it; the engine's switches (overlapped steps, CUDA graphs, warm-up, experimental fp8 KV) and
the kernels' settings are fields here, passed down, never read from the environment below the
CLI (`pdserve.engine_args`).
Unknown keys and bad values raise `ValueError` naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "mixtral", "qwen3_moe", "olmoe")
# RMSNorm of q and k before RoPE: none, per head over head_dim (Qwen3), or over the whole
# q / k projection (OLMoE)
QK_NORMS = ("none", "head", "proj")
Role = Literal["mixed", "prefill", "decode"]
ROLES = ("mixed", "prefill", "decode")
DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts model: a replicated router (softmax over the
    experts, the top-k kept, divided by their sum when `renormalize`) and `num_experts` SwiGLU
    experts of width `intermediate_size`. `layers` are the layers whose MLP is sparse; the others
    are dense, of the model's `intermediate_size` (Qwen3-MoE's `mlp_only_layers` and
    `decoder_sparse_step`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        for key in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"moe config: {key} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"moe config: top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if not isinstance(self.layers, tuple) or list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"moe config: layers must be a sorted tuple of distinct indices, got {self.layers!r}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: str = "none"  # one of QK_NORMS
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] after the norms (OLMoE)
    moe: MoEConfig | None = None  # the sparse MLP of the layers in moe.layers
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                    "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {key} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"model config: qk_norm must be one of {', '.join(QK_NORMS)}, got {self.qk_norm!r}")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"model config: clip_qkv must be > 0 or None, got {self.clip_qkv!r}")
        if self.moe is not None and any(not 0 <= i < self.num_layers for i in self.moe.layers):
            raise ValueError(f"model config: moe layers {self.moe.layers} outside the {self.num_layers} layers")

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index in self.moe.layers

    @property
    def has_dense_layers(self) -> bool:
        """Whether any layer's MLP is dense (of width intermediate_size)."""
        return self.moe is None or len(self.moe.layers) < self.num_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # GPU: fraction of free device memory given to the KV pools; CPU: GiB.
    gpu_memory_fraction: float = 0.85
    cpu_kv_gib: float = 0.5
    num_blocks: int | None = None  # overrides the memory budget when set (tests)
    enable_prefix_caching: bool = True
    # Decode-only steps replay CUDA graphs captured for padded batch sizes up to this bound
    # (CUDA + Triton kernels only). `enforce_eager` (--no-cuda-graphs) turns them off.
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 256
    # Steps with prefill rows of up to prefill_graph_max_tokens tokens in all replay piecewise CUDA
    # graphs, attention eager between them (pdserve/piecewise_graphs.py; CUDA + Triton, TP 1;
    # elsewhere ignored). --no-prefill-graphs turns them off.
    prefill_graphs: bool = True
    prefill_graph_max_tokens: int = 512
    # Decode-only steps on the torch (CPU) path run a torch.compile'd forward: fewer, fused
    # ops. The first steps of each shape class (batch 1, batch > 1) compile (tens of seconds each;
    # docs/usage.md, "CPU speed-ups"); off by default.
    compile_cpu_decode: bool = False
    # fp32 on the CPU: projections and LM head in MKL's packed GEMM layout (pdserve/kernels/linear.py):
    # faster matmuls from a few running requests up, a little slower at 1-2 (the figures:
    # docs/usage.md, "CPU speed-ups"); the same memory but for a packed copy of a tied LM head.
    # Ignored elsewhere.
    cpu_packed_weights: bool = True
    # KV pool dtype: "auto" (the model's dtype), "bf16", or "fp8" (e4m3 with a float32 scale per
    # token and head, pdserve/kernels/kv_quant.py): about half the bytes to read, hold and ship.
    kv_cache_dtype: str = "auto"
    # fp8 KV on CUDA is refused unless this is set (--experimental-fp8-kv): it is not verified on
    # GPUs yet (where it stands: docs/usage.md, "FP8 KV cache").
    experimental_fp8_kv: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"cache config: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.cuda_graph_max_batch <= 0:
            raise ValueError(f"cache config: cuda_graph_max_batch must be > 0, got {self.cuda_graph_max_batch}")
        if self.prefill_graph_max_tokens <= 0:
            raise ValueError(f"cache config: prefill_graph_max_tokens must be > 0, got {self.prefill_graph_max_tokens}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"cache config: block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"cache config: gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.cpu_kv_gib <= 0:
            raise ValueError(f"cache config: cpu_kv_gib must be > 0, got {self.cpu_kv_gib}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"cache config: num_blocks must be > 0, got {self.num_blocks}")


# The scheduler's sizes when not given, by device type: (max_num_batched_tokens, max_num_seqs).
# CPU: what a 2-core machine steps through in tens of milliseconds. CUDA: vLLM's OpenAI server's
# sizes for datacenter GPUs, which serve an 8B model's prompts at a fraction of the CPU sizes' TTFT
# (docs/results.md, "Figures behind the code's choices").
SCHEDULER_DEFAULTS: dict[str, tuple[int, int]] = {"cpu": (512, 64), "cuda": (8192, 256)}


@dataclass(frozen=True)
class SchedulerConfig:
    # None: the device's default (SCHEDULER_DEFAULTS, filled in by `resolve_scheduler`)
    max_num_batched_tokens: int | None = None  # per-step token budget (prefill chunks + decodes)
    max_num_seqs: int | None = None  # cap on running requests
    role: str = "mixed"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError("scheduler config: max_num_batched_tokens must be > 0")
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ValueError("scheduler config: max_num_seqs must be > 0")
        if self.role not in ROLES:
            raise ValueError(f"scheduler config: role must be one of {ROLES}, got {self.role!r}")

    @property
    def resolved(self) -> bool:
        return self.max_num_batched_tokens is not None and self.max_num_seqs is not None


def resolve_scheduler(config: SchedulerConfig, device_type: str) -> tuple[SchedulerConfig, str]:
    """`config` with the sizes not given (None) set to `device_type`'s defaults ("cpu" or
    "cuda", a "cuda:1" counts as "cuda"), and one line saying what was chosen, e.g.
    "max_num_batched_tokens=8192 max_num_seqs=256 (defaults for cuda)". Given sizes stay."""
    kind = device_type.split(":", 1)[0]
    if kind not in SCHEDULER_DEFAULTS:
        raise ValueError(f"scheduler config: no default sizes for device {device_type!r}; "
                         f"known: {', '.join(SCHEDULER_DEFAULTS)}")
    tokens, seqs = SCHEDULER_DEFAULTS[kind]
    defaulted = [k for k in ("max_num_batched_tokens", "max_num_seqs") if getattr(config, k) is None]
    out = dataclasses.replace(config, max_num_batched_tokens=config.max_num_batched_tokens or tokens,
                              max_num_seqs=config.max_num_seqs or seqs)
    if len(defaulted) == 2:
        source = f"defaults for {kind}"
    elif defaulted:
        source = f"{defaulted[0]} the default for {kind}, the other given"
    else:
        source = "given"
    return out, f"max_num_batched_tokens={out.max_num_batched_tokens} max_num_seqs={out.max_num_seqs} ({source})"


@dataclass(frozen=True)
class KernelConfig:
    """The kernels' settings. They are process-wide: the engine sets them when it starts
    (`pdserve.kernels.dispatch.configure`, which refuses a bad value by name)."""

    backend: str = "auto"  # auto | torch | triton (auto: Triton on CUDA when it imports, else the torch references)
    prefill_attention: str = "auto"  # auto | dense | paged (pdserve.kernels.prefill_attention.dense_applies)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"
    tokenizer: str | None = None  # a tokenizer spec that replaces the model's own (pdserve.loaders)
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # None: cuda when available, else cpu
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Overlapped decode steps (pdserve/engine.py): launch the next decode-only CUDA-graph step
    # before the host has read the last one's tokens (--no-overlap-steps: off).
    overlap_steps: bool = True
    # A worker runs the shapes serving uses before it says it is ready (pdserve/warmup.py;
    # --no-warmup: skip).
    warmup: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # ranks of one engine (pdserve.parallel): heads, MLP columns and vocabulary split N ways
    tensor_parallel_size: int = 1
    # mixture-of-experts models at tensor_parallel_size N: the experts are divided among the N
    # ranks (each holds E / N whole experts) instead of each expert's width split N ways
    expert_parallel: bool = False
    # None: the process's PDSERVE_KERNEL_BACKEND and PDSERVE_PREFILL_ATTENTION, read when the engine
    # starts (`pdserve.engine_args.kernel_config`); the CLI fills it in
    kernels: KernelConfig | None = None

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"engine config: tensor_parallel_size must be a positive integer, got {tp!r}")
        if not isinstance(self.expert_parallel, bool):
            raise ValueError(f"engine config: expert_parallel must be true or false, got {self.expert_parallel!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"engine config: dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("engine config: max_model_len must be > 0")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        """Builds a config from nested dicts; unknown keys raise ValueError naming the key."""
        nested = {"cache": CacheConfig, "scheduler": SchedulerConfig, "kernels": KernelConfig}
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise ValueError(f"engine config: unknown key {key!r}")
            if key in nested:
                if not isinstance(value, dict):
                    raise ValueError(f"engine config: {key} must be a mapping")
                sub_known = {f.name for f in dataclasses.fields(nested[key])}
                for sub in value:
                    if sub not in sub_known:
                        raise ValueError(f"engine config: unknown key {key}.{sub}")
                value = nested[key](**value)
            kwargs[key] = value
        return cls(**kwargs)
