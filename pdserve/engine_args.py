"""Engine flags shared by the `pdserve` subcommands that load a model (generate, up, worker).

`ENGINE_DEFAULTS` is the single source of the defaults: the argparse flags, the YAML keys of
`pdserve up --config` and `engine_config` all read it.

The engine's switches are flags too (`--[no-]overlap-steps`, `--[no-]cuda-graphs`,
`--[no-]warmup`, `--experimental-fp8-kv`, `--[no-]prefill-graphs`). Each may also be set by an environment variable
(`ENGINE_ENV`, read through `pdserve.environment` here and nowhere below): a switch not given
(None) takes the variable's value when it is set, else its default, in `resolve_switches`. A
flag or a config-file key wins over the variable. The kernels' settings have no flag: their
variables (PDSERVE_KERNEL_BACKEND, PDSERVE_PREFILL_ATTENTION) are read here too, into
`EngineConfig.kernels` (`kernel_config`).

`max_num_batched_tokens` and `max_num_seqs` not given stay None here: the engine fills them
in for its device (`pdserve.config.resolve_scheduler`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from pdserve import environment
from pdserve.config import KV_CACHE_DTYPES, CacheConfig, EngineConfig, KernelConfig, SchedulerConfig

ENGINE_DEFAULTS: dict[str, Any] = {
    "model": "smollm2",
    "tokenizer": None,
    "dtype": None,
    "device": None,
    "max_model_len": None,
    "kv_cache_gib": 0.5,
    "gpu_memory_fraction": 0.85,
    "block_size": 16,
    "max_num_batched_tokens": None,  # None: the device's default (8192 on CUDA, 512 on CPU)
    "max_num_seqs": None,  # None: the device's default (256 on CUDA, 64 on CPU)
    "no_prefix_caching": False,
    "compile": False,
    "no_packed_weights": False,
    "kv_cache_dtype": "auto",
    "expert_parallel": False,
    # switches: None = not given (the environment variable of ENGINE_ENV, else SWITCH_DEFAULTS)
    "overlap_steps": None,
    "cuda_graphs": None,
    "warmup": None,
    "experimental_fp8_kv": None,
    "prefill_graphs": None,
}

SWITCH_DEFAULTS: dict[str, bool] = {"overlap_steps": True, "cuda_graphs": True, "warmup": True,
                                    "experimental_fp8_kv": False, "prefill_graphs": True}
ENGINE_ENV: dict[str, str] = {
    "overlap_steps": "PDSERVE_OVERLAP_STEPS",
    "cuda_graphs": "PDSERVE_CUDA_GRAPHS",
    "warmup": "PDSERVE_WARMUP",
    "experimental_fp8_kv": "PDSERVE_EXPERIMENTAL_FP8_KV",
    "prefill_graphs": "PDSERVE_PREFILL_GRAPHS",
}
def resolve_switches(values: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, bool]:
    """The engine switches: each given value (True/False), else its ENGINE_ENV variable when set
    (1/0, true/false, yes/no, on/off), else SWITCH_DEFAULTS; ValueError naming a bad variable.
    The one place the engine's switch variables are read."""
    out: dict[str, bool] = {}
    for key, default in SWITCH_DEFAULTS.items():
        value = values.get(key)
        if value is None and environment.is_set(ENGINE_ENV[key], environ):
            value = environment.get(ENGINE_ENV[key], environ)
        out[key] = default if value is None else bool(value)
    return out


def kernel_config(environ: Mapping[str, str] | None = None) -> KernelConfig:
    """The kernels' settings from PDSERVE_KERNEL_BACKEND and PDSERVE_PREFILL_ATTENTION (auto when
    unset); ValueError naming a bad variable."""
    return KernelConfig(backend=environment.get("PDSERVE_KERNEL_BACKEND", environ),
                        prefill_attention=environment.get("PDSERVE_PREFILL_ATTENTION", environ))


def int_arg(flag: str):
    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    return parse


def float_arg(flag: str):
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    return parse


def add_engine_args(p: argparse.ArgumentParser, *, suppress_defaults: bool = False) -> None:
    """Adds the engine flags. With `suppress_defaults`, flags not given stay out of the namespace
    (so that a config file can fill them in before the defaults do)."""

    def default(key: str) -> Any:
        return argparse.SUPPRESS if suppress_defaults else ENGINE_DEFAULTS[key]

    p.add_argument("--model", default=default("model"),
                   help="smollm2 (default), a Hugging Face directory, a .gguf file, or random:<name>")
    p.add_argument("--tokenizer", default=default("tokenizer"), metavar="PATH",
                   help="tokenizer to use instead of the model's own: a Hugging Face directory, a "
                        "tokenizer.json or a .gguf file (random:<name> models use it too)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=default("dtype"),
                   help="weights and activations (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default=default("device"), help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-model-len", type=int_arg("--max-model-len"), default=default("max_model_len"),
                   help="longest sequence, prompt + generated tokens (default: the model's context length)")
    p.add_argument("--kv-cache-gib", type=float_arg("--kv-cache-gib"), default=default("kv_cache_gib"),
                   help="KV cache budget on CPU, GiB")
    p.add_argument("--gpu-memory-fraction", type=float_arg("--gpu-memory-fraction"),
                   default=default("gpu_memory_fraction"),
                   help=f"CUDA: fraction of free GPU memory given to the KV cache (default "
                        f"{ENGINE_DEFAULTS['gpu_memory_fraction']}; on CPU --kv-cache-gib sets the budget)")
    p.add_argument("--block-size", type=int_arg("--block-size"), default=default("block_size"),
                   help=f"tokens per KV cache block (default {ENGINE_DEFAULTS['block_size']})")
    p.add_argument("--max-num-batched-tokens", type=int_arg("--max-num-batched-tokens"),
                   default=default("max_num_batched_tokens"),
                   help="tokens one engine step may process, prompt chunks and decodes together "
                        "(default: device-dependent, 8192 on CUDA and 512 on CPU)")
    p.add_argument("--max-num-seqs", type=int_arg("--max-num-seqs"), default=default("max_num_seqs"),
                   help="sequences running at once in one engine (default: device-dependent, 256 on CUDA "
                        "and 64 on CPU)")
    p.add_argument("--no-prefix-caching", action="store_true", default=default("no_prefix_caching"),
                   help="do not reuse the KV blocks of a prompt prefix seen before (default: reuse them)")
    p.add_argument("--compile", action="store_true", default=default("compile"),
                   help="CPU: run decode steps through torch.compile (the first steps compile, "
                        "~40 s per shape on 2 cores; faster decode after)")
    p.add_argument("--no-packed-weights", action="store_true", default=default("no_packed_weights"),
                   help="CPU fp32: keep weights dense instead of in MKL's packed GEMM layout")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=default("kv_cache_dtype"),
                   help="KV cache dtype: auto (the model's), bf16, or fp8 (e4m3, a scale per token "
                        "and head: half the KV bytes)")
    p.add_argument("--expert-parallel", action="store_true", default=default("expert_parallel"),
                   help="mixture-of-experts models at --tensor-parallel-size N: divide the experts among the N "
                        "ranks (E / N whole experts each) instead of splitting every expert's width")
    bool_flag = argparse.BooleanOptionalAction
    p.add_argument("--overlap-steps", action=bool_flag, default=default("overlap_steps"),
                   help="GPU: launch the next decode-only step before reading the last one's tokens "
                        f"(default: on, or ${ENGINE_ENV['overlap_steps']}=0/1)")
    p.add_argument("--cuda-graphs", action=bool_flag, default=default("cuda_graphs"),
                   help="GPU: replay CUDA graphs for decode-only steps "
                        f"(default: on, or ${ENGINE_ENV['cuda_graphs']}=0/1)")
    p.add_argument("--warmup", action=bool_flag, default=default("warmup"),
                   help="worker: run the serving shapes (kernels, CUDA graphs) before saying it is ready "
                        f"(default: on, or ${ENGINE_ENV['warmup']}=0/1)")
    p.add_argument("--experimental-fp8-kv", action=bool_flag, default=default("experimental_fp8_kv"),
                   help="allow --kv-cache-dtype fp8 on CUDA, whose GPU tests failed on an H200 "
                        f"(default: off, or ${ENGINE_ENV['experimental_fp8_kv']}=0/1)")
    p.add_argument("--prefill-graphs", action=bool_flag, default=default("prefill_graphs"),
                   help="GPU: steps with prefill rows of up to 512 tokens in all replay piecewise CUDA graphs, "
                        "attention eager between them (needs --cuda-graphs and TP 1) "
                        f"(default: on, or ${ENGINE_ENV['prefill_graphs']}=0/1)")


def positive_int_arg(flag: str):
    def parse(text: str) -> int:
        value = int_arg(flag)(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
        return value
    return parse


def add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    """`-tp N`: the model split over N ranks, N - 1 of them local processes (pdserve.parallel)."""
    p.add_argument("-tp", "--tensor-parallel-size", type=positive_int_arg("--tensor-parallel-size"), default=1,
                   metavar="N", help="split the model over N ranks (one GPU each on CUDA; local "
                                     "processes over gloo on CPU)")


def engine_kwargs(args: argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `pdserve.llm.LLM` from parsed engine flags (switches not given: the
    environment, `resolve_switches`; the kernels': `kernel_config`)."""
    v = vars(args) if isinstance(args, argparse.Namespace) else args
    sw = resolve_switches(v)
    return dict(model=v["model"], tokenizer=v.get("tokenizer"), dtype=v["dtype"], device=v["device"],
                max_model_len=v["max_model_len"], overlap_steps=sw["overlap_steps"],
                enforce_eager=not sw["cuda_graphs"], experimental_fp8_kv=sw["experimental_fp8_kv"],
                prefill_graphs=sw["prefill_graphs"], kv_cache_gib=v["kv_cache_gib"],
                gpu_memory_fraction=v["gpu_memory_fraction"],
                block_size=v["block_size"], max_num_batched_tokens=v["max_num_batched_tokens"],
                max_num_seqs=v["max_num_seqs"], enable_prefix_caching=not v["no_prefix_caching"],
                compile=v.get("compile", False), packed_weights=not v.get("no_packed_weights", False),
                kv_cache_dtype=v.get("kv_cache_dtype", "auto"),
                tensor_parallel_size=v.get("tensor_parallel_size", 1), expert_parallel=v.get("expert_parallel", False),
                kernels=kernel_config())


def engine_config(values: argparse.Namespace | Mapping[str, Any], role: str = "mixed") -> EngineConfig:
    """The `EngineConfig` of one worker from engine flag values (ValueError names a bad value;
    switches not given: the environment, `resolve_switches`; the kernels': `kernel_config`)."""
    v = vars(values) if isinstance(values, argparse.Namespace) else values
    sw = resolve_switches(v)
    return EngineConfig(
        model=v["model"], tokenizer=v.get("tokenizer"), dtype=v["dtype"], device=v["device"],
        max_model_len=v["max_model_len"], overlap_steps=sw["overlap_steps"], warmup=sw["warmup"],
        cache=CacheConfig(block_size=v["block_size"], cpu_kv_gib=v["kv_cache_gib"],
                          gpu_memory_fraction=v["gpu_memory_fraction"],
                          enable_prefix_caching=not v["no_prefix_caching"],
                          compile_cpu_decode=v.get("compile", False),
                          cpu_packed_weights=not v.get("no_packed_weights", False),
                          kv_cache_dtype=v.get("kv_cache_dtype", "auto"),
                          enforce_eager=not sw["cuda_graphs"], experimental_fp8_kv=sw["experimental_fp8_kv"],
                          prefill_graphs=sw["prefill_graphs"]),
        scheduler=SchedulerConfig(max_num_batched_tokens=v["max_num_batched_tokens"],
                                  max_num_seqs=v["max_num_seqs"], role=role),
        tensor_parallel_size=v.get("tensor_parallel_size", 1),
        expert_parallel=v.get("expert_parallel", False),
        kernels=kernel_config(),
    )
