"""`UpConfig`: everything `pdserve up` needs, from flags and an optional YAML file.

The YAML file takes the flags' long names as keys (`max-model-len` or `max_model_len`);
flags given on the command line win over the file, the file wins over the defaults. Unknown
keys and bad values raise `ValueError` naming the flag, or the file and its key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import AliasChoices, Field, StrictStr, create_model

from pdserve.loadgen import yamlconfig
from pdserve.engine_args import ENGINE_DEFAULTS

MODES = ("disaggregated", "colocated", "hybrid")
# hybrid: mixed workers that can also send and receive KV; the router chooses per request
# between a local run and a prefill on one worker with the decode on another


def router_mode(mode: str) -> str:
    """The router's placement mode for a launcher mode (hybrid pairs any two mixed workers)."""
    return "disaggregated" if mode == "hybrid" else mode
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_RESOURCE_KEYS = ("resources", "prefill_resources", "decode_resources")


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


@dataclass(frozen=True)
class UpConfig:
    # engine (one EngineConfig per worker, see `engine_values`)
    model: str = ENGINE_DEFAULTS["model"]
    tokenizer: str | None = ENGINE_DEFAULTS["tokenizer"]
    dtype: str | None = ENGINE_DEFAULTS["dtype"]
    device: str | None = ENGINE_DEFAULTS["device"]
    max_model_len: int | None = ENGINE_DEFAULTS["max_model_len"]
    kv_cache_gib: float = ENGINE_DEFAULTS["kv_cache_gib"]
    gpu_memory_fraction: float = ENGINE_DEFAULTS["gpu_memory_fraction"]
    block_size: int = ENGINE_DEFAULTS["block_size"]
    max_num_batched_tokens: int | None = ENGINE_DEFAULTS["max_num_batched_tokens"]  # None: the device's
    max_num_seqs: int | None = ENGINE_DEFAULTS["max_num_seqs"]  # None: the device's
    no_prefix_caching: bool = ENGINE_DEFAULTS["no_prefix_caching"]
    compile: bool = ENGINE_DEFAULTS["compile"]
    no_packed_weights: bool = ENGINE_DEFAULTS["no_packed_weights"]
    kv_cache_dtype: str = ENGINE_DEFAULTS["kv_cache_dtype"]
    expert_parallel: bool = ENGINE_DEFAULTS["expert_parallel"]  # MoE: experts divided among a worker's TP ranks
    # switches; None: the environment variable (pdserve.engine_args.ENGINE_ENV), else the default
    overlap_steps: bool | None = ENGINE_DEFAULTS["overlap_steps"]
    cuda_graphs: bool | None = ENGINE_DEFAULTS["cuda_graphs"]
    warmup: bool | None = ENGINE_DEFAULTS["warmup"]
    experimental_fp8_kv: bool | None = ENGINE_DEFAULTS["experimental_fp8_kv"]
    prefill_graphs: bool | None = ENGINE_DEFAULTS["prefill_graphs"]
    # pools
    mode: str = "disaggregated"
    prefill: int = 1
    decode: int = 1
    replicas: int | None = None  # colocated/hybrid: number of mixed workers (default prefill + decode)
    worker_cpus: float = 1.0
    worker_gpus: float | None = None  # None: 1 when the Ray cluster has GPUs, else 0
    resources: Mapping[str, float] = field(default_factory=dict)  # every worker
    prefill_resources: Mapping[str, float] = field(default_factory=dict)
    decode_resources: Mapping[str, float] = field(default_factory=dict)
    placement_strategy: str = "PACK"
    kv_backend: str = "ucx"
    # tensor parallelism: ranks per worker (every pool), and per pool (None: tensor_parallel_size)
    tensor_parallel_size: int = 1
    prefill_tp: int | None = None
    decode_tp: int | None = None
    # Ray
    address: str | None = None  # None: start a local Ray; "auto" or "ray://host:port": join one
    namespace: str = "pdserve"
    cluster_name: str = "default"
    ray_object_store_mb: int = 256  # only for a Ray we start
    startup_timeout_s: float = 600.0
    # router
    policy: str = "round-robin"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the --model spec
    kv_deadline_s: float = 10.0
    kv_wire_precision: str = "auto"  # the KV's precision on the wire: auto | full | fp8
    worker_wait_s: float = 30.0  # a request no worker can serve waits this long, then 503
    max_tokens_default: int | None = None  # max_tokens of a request that gives none (None: OpenAI's defaults)
    max_queued_requests: int = 1024  # requests without a first token yet (waiting for KV blocks); past it 429
    queue_timeout_s: float = 600.0  # a request without a first token after this gets 503
    usage_timing: bool = False  # usage.pdserve_timing in every response (else only when a request asks)
    topology: str | None = None
    profile: str | None = None
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    admission_control: bool = False
    no_calibration: bool = False
    no_local_prefill: bool = False
    # autoscaling: None/False off; True (--autoscale) or the file's `autoscale:` mapping
    # (launcher.autoscale.rule.AutoscaleConfig.from_mapping), made an AutoscaleConfig here
    autoscale: Any = None

    def __post_init__(self) -> None:
        def fail(key: str, message: str) -> None:
            raise ValueError(f"{flag(key)}: {message}")

        if not isinstance(self.model, str) or not self.model.strip():
            fail("model", "must be a non-empty model spec")
        if self.mode not in MODES:
            fail("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        for key in ("prefill", "decode"):
            if getattr(self, key) < 0:
                fail(key, f"must be >= 0, got {getattr(self, key)}")
        if self.mode == "disaggregated":
            if self.replicas is not None:
                fail("replicas", "applies only to --mode colocated (use --prefill and --decode)")
            for key in ("prefill", "decode"):
                if getattr(self, key) < 1:
                    fail(key, "must be >= 1 in --mode disaggregated")
        elif self.replicas is not None and self.replicas < 1:
            fail("replicas", f"must be >= 1, got {self.replicas}")
        elif self.replicas is None and self.prefill + self.decode < 1:
            fail("replicas", f"--mode {self.mode} needs at least one worker")
        if not (self.worker_cpus >= 0 and math.isfinite(self.worker_cpus)):
            fail("worker_cpus", f"must be >= 0, got {self.worker_cpus}")
        if self.worker_gpus is not None and not (self.worker_gpus >= 0 and math.isfinite(self.worker_gpus)):
            fail("worker_gpus", f"must be >= 0, got {self.worker_gpus}")
        for key in ("tensor_parallel_size", "prefill_tp", "decode_tp"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                fail(key, f"must be a positive integer, got {value!r}")
        if self.mode != "disaggregated":
            for key in ("prefill_tp", "decode_tp"):
                if getattr(self, key) is not None:
                    fail(key, f"applies to --mode disaggregated (--mode {self.mode}: use --tensor-parallel-size)")
        for key in _RESOURCE_KEYS:
            object.__setattr__(self, key, check_resources(flag(key), getattr(self, key)))
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            fail("placement_strategy", f"must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                                       f"got {self.placement_strategy!r}")
        from pdserve.kvtransfer import available_backends

        if self.kv_backend not in available_backends():
            fail("kv_backend", f"must be one of {', '.join(available_backends())}, got {self.kv_backend!r}")
        if self.mode in ("disaggregated", "hybrid") and self.kv_backend == "fake":
            fail("kv_backend", "'fake' moves KV only inside one process; Ray workers need 'ucx' or 'nixl'")
        if not 1 <= self.port <= 65535:
            fail("port", f"must be in 1..65535, got {self.port}")
        for key in ("kv_deadline_s", "startup_timeout_s"):
            value = getattr(self, key)
            if not (value > 0 and math.isfinite(value)):
                fail(key, f"must be > 0, got {value}")
        if self.kv_wire_precision not in ("auto", "full", "fp8"):
            fail("kv_wire_precision", f"must be one of auto, full, fp8, got {self.kv_wire_precision!r}")
        if not (self.worker_wait_s >= 0 and math.isfinite(self.worker_wait_s)):
            fail("worker_wait_s", f"must be >= 0, got {self.worker_wait_s}")
        if self.max_queued_requests < 1:
            fail("max_queued_requests", f"must be >= 1, got {self.max_queued_requests}")
        if not (self.queue_timeout_s > 0 and math.isfinite(self.queue_timeout_s)):
            fail("queue_timeout_s", f"must be > 0, got {self.queue_timeout_s}")
        if self.ray_object_store_mb < 75:
            fail("ray_object_store_mb", f"must be >= 75 (Ray's minimum), got {self.ray_object_store_mb}")
        for key in ("namespace", "cluster_name"):
            value = getattr(self, key)
            if not value or ":" in value:
                fail(key, f"must be non-empty without ':', got {value!r}")
        if self.api_key is not None and not self.api_key:
            fail("api_key", "must not be empty")
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            fail("max_tokens_default", f"must be >= 1, got {self.max_tokens_default}")
        check_policy(self.policy)
        if self.autoscale is not None and self.autoscale is not False:
            from pdserve.launcher.autoscale.rule import AutoscaleConfig

            if not isinstance(self.autoscale, AutoscaleConfig):
                try:
                    object.__setattr__(self, "autoscale", AutoscaleConfig.from_mapping(self.autoscale))
                except (ValueError, TypeError) as e:
                    fail("autoscale", str(e).removeprefix("autoscale: "))
            if self.slo_ttft is None and self.slo_tpot is None:
                fail("autoscale", "needs the SLOs it scales for: --slo-ttft and/or --slo-tpot")
        else:
            object.__setattr__(self, "autoscale", None)

    # ---- derived ---------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def pool_sizes(self) -> dict[str, int]:
        """role -> number of workers."""
        if self.mode in ("colocated", "hybrid"):
            return {"mixed": self.replicas if self.replicas is not None else self.prefill + self.decode}
        return {"prefill": self.prefill, "decode": self.decode}

    def pool_tp(self, role: str) -> int:
        """Ranks per worker of `role` (--prefill-tp / --decode-tp, else --tensor-parallel-size)."""
        own = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role)
        return own if own is not None else self.tensor_parallel_size

    def num_ranks(self) -> int:
        """Engine ranks over every pool (a GPU each on CUDA)."""
        return sum(size * self.pool_tp(role) for role, size in self.pool_sizes().items())

    def pool_resources(self, role: str) -> dict[str, float]:
        """Custom Ray resources each worker of `role` asks for."""
        own = {"prefill": self.prefill_resources, "decode": self.decode_resources}.get(role, {})
        return {**self.resources, **own}

    def engine_values(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in ENGINE_DEFAULTS}


_FIELDS = {f.name: f for f in dataclasses.fields(UpConfig)}
_INTS = {"max_model_len", "block_size", "max_num_batched_tokens", "max_num_seqs", "prefill", "decode", "replicas",
         "port", "ray_object_store_mb", "max_tokens_default", "max_queued_requests", "tensor_parallel_size",
         "prefill_tp", "decode_tp"}
_FLOATS = {"kv_cache_gib", "gpu_memory_fraction", "worker_cpus", "worker_gpus", "kv_deadline_s", "startup_timeout_s",
           "worker_wait_s", "slo_ttft", "slo_tpot", "queue_timeout_s"}
_BOOLS = {"no_prefix_caching", "compile", "no_packed_weights", "admission_control", "no_calibration",
          "no_local_prefill", "usage_timing", "overlap_steps", "cuda_graphs", "warmup", "experimental_fp8_kv",
          "prefill_graphs", "expert_parallel"}
_OPTIONAL = {"tokenizer", "dtype", "device", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
             "overlap_steps", "cuda_graphs", "warmup", "experimental_fp8_kv", "prefill_graphs", "replicas",
             "worker_gpus", "address", "api_key",
             "served_model_name", "topology", "profile", "slo_ttft", "slo_tpot", "max_tokens_default",
             "prefill_tp", "decode_tp", "autoscale"}


def check_policy(name: str) -> None:
    """ValueError naming --policy unless `name` is in the router's placement registry."""
    from pdserve.router.placement.registry import POLICIES

    if name not in POLICIES:
        raise ValueError(f"--policy: unknown placement policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")


def check_resources(name: str, value: Any) -> dict[str, float]:
    """A mapping of Ray resource name -> amount >= 0; ValueError naming `name`."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}: must be a mapping of resource name to amount, e.g. {{\"node_a\": 1}}")
    out: dict[str, float] = {}
    for key, amount in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{name}: resource names must be non-empty strings, got {key!r}")
        if key in ("CPU", "GPU", "memory"):
            raise ValueError(f"{name}: {key!r} is set by --worker-cpus/--worker-gpus, not as a custom resource")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount >= 0:
            raise ValueError(f"{name}: amount of {key!r} must be a number >= 0, got {amount!r}")
        out[key] = float(amount)
    return out


def _file_type(key: str) -> Any:
    """The type a key of the YAML file takes (yamlconfig's types never coerce)."""
    if key == "autoscale":  # true/false, or the mapping launcher.autoscale.rule.AutoscaleConfig reads
        return yamlconfig.Bool | dict[str, Any] | None
    kind = (yamlconfig.Bool if key in _BOOLS else yamlconfig.whole() if key in _INTS
            else yamlconfig.number() if key in _FLOATS else dict[str, Any] if key in _RESOURCE_KEYS else StrictStr)
    return kind | None if key in _OPTIONAL else kind


UpConfigFile = create_model(
    "UpConfigFile", __base__=yamlconfig.Schema,
    **{key: (_file_type(key), Field(None, validation_alias=AliasChoices(key, key.replace("_", "-"))))
       for key in _FIELDS},
)
"""`pdserve up --config`'s schema: every UpConfig field, as `max_model_len` or `max-model-len`."""


def read_config_file(path: str) -> dict[str, Any]:
    """The YAML file's settings (only those it gives), keys normalized to field names;
    ValueError naming the file, the line and the key."""
    doc = yamlconfig.read(path, what="the config file")
    if isinstance(doc.data, dict):
        seen: dict[str, Any] = {}
        for raw in doc.data:
            key = str(raw).replace("-", "_")
            if key in seen:
                raise doc.error((raw,), f"given twice (as {seen[key]!r})", at_key=True)
            seen[key] = raw
    settings = yamlconfig.validate(doc, UpConfigFile)
    return {key: getattr(settings, key) for key in settings.model_fields_set}


def load_up_config(flags: Mapping[str, Any], config_file: str | None = None) -> UpConfig:
    """Flags given on the command line (only those) over the file's settings over the defaults."""
    unknown = sorted(set(flags) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown settings: {unknown}")
    settings = read_config_file(config_file) if config_file else {}
    if flags.get("autoscale") is True and isinstance(settings.get("autoscale"), Mapping):
        flags = {k: v for k, v in flags.items() if k != "autoscale"}  # --autoscale with the file's settings
    settings.update(flags)
    try:
        return UpConfig(**settings)
    except ValueError as e:
        if config_file:
            from_file = [key for key in settings if key not in flags and str(e).startswith(flag(key) + ":")]
            if from_file:
                raise ValueError(f"{config_file}: {e}") from None
        raise
