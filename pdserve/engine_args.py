"""Engine flags shared by the `pdserve` subcommands that load a model (generate, up, worker).

`ENGINE_DEFAULTS` is the single source of the defaults: the argparse flags, the YAML keys of
`pdserve up --config` and `engine_config` all read it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from pdserve.config import KV_CACHE_DTYPES, CacheConfig, EngineConfig, SchedulerConfig

ENGINE_DEFAULTS: dict[str, Any] = {
    "model": "smollm2",
    "tokenizer": None,
    "dtype": None,
    "device": None,
    "max_model_len": None,
    "kv_cache_gib": 0.5,
    "gpu_memory_fraction": 0.85,
    "block_size": 16,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 64,
    "no_prefix_caching": False,
    "compile": False,
    "no_packed_weights": False,
    "kv_cache_dtype": "auto",
}


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
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=default("dtype"))
    p.add_argument("--device", default=default("device"), help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-model-len", type=int_arg("--max-model-len"), default=default("max_model_len"))
    p.add_argument("--kv-cache-gib", type=float_arg("--kv-cache-gib"), default=default("kv_cache_gib"),
                   help="KV cache budget on CPU, GiB")
    p.add_argument("--gpu-memory-fraction", type=float_arg("--gpu-memory-fraction"),
                   default=default("gpu_memory_fraction"))
    p.add_argument("--block-size", type=int_arg("--block-size"), default=default("block_size"))
    p.add_argument("--max-num-batched-tokens", type=int_arg("--max-num-batched-tokens"),
                   default=default("max_num_batched_tokens"))
    p.add_argument("--max-num-seqs", type=int_arg("--max-num-seqs"), default=default("max_num_seqs"))
    p.add_argument("--no-prefix-caching", action="store_true", default=default("no_prefix_caching"))
    p.add_argument("--compile", action="store_true", default=default("compile"),
                   help="CPU: run decode steps through torch.compile (the first steps compile, "
                        "~40 s per shape on 2 cores; faster decode after)")
    p.add_argument("--no-packed-weights", action="store_true", default=default("no_packed_weights"),
                   help="CPU fp32: keep weights dense instead of in MKL's packed GEMM layout")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=default("kv_cache_dtype"),
                   help="KV cache dtype: auto (the model's), bf16, or fp8 (e4m3, a scale per token "
                        "and head: half the KV bytes)")


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
    """Keyword arguments of `pdserve.llm.LLM` from parsed engine flags."""
    v = vars(args) if isinstance(args, argparse.Namespace) else args
    return dict(model=v["model"], tokenizer=v.get("tokenizer"), dtype=v["dtype"], device=v["device"], max_model_len=v["max_model_len"],
                kv_cache_gib=v["kv_cache_gib"], gpu_memory_fraction=v["gpu_memory_fraction"],
                block_size=v["block_size"], max_num_batched_tokens=v["max_num_batched_tokens"],
                max_num_seqs=v["max_num_seqs"], enable_prefix_caching=not v["no_prefix_caching"],
                compile=v.get("compile", False), packed_weights=not v.get("no_packed_weights", False),
                kv_cache_dtype=v.get("kv_cache_dtype", "auto"),
                tensor_parallel_size=v.get("tensor_parallel_size", 1))


def engine_config(values: argparse.Namespace | Mapping[str, Any], role: str = "mixed") -> EngineConfig:
    """The `EngineConfig` of one worker from engine flag values (ValueError names a bad value)."""
    v = vars(values) if isinstance(values, argparse.Namespace) else values
    return EngineConfig(
        model=v["model"], tokenizer=v.get("tokenizer"), dtype=v["dtype"], device=v["device"],
        max_model_len=v["max_model_len"], cache=CacheConfig(block_size=v["block_size"], cpu_kv_gib=v["kv_cache_gib"],
                          gpu_memory_fraction=v["gpu_memory_fraction"],
                          enable_prefix_caching=not v["no_prefix_caching"],
                          compile_cpu_decode=v.get("compile", False),
                          cpu_packed_weights=not v.get("no_packed_weights", False),
                          kv_cache_dtype=v.get("kv_cache_dtype", "auto")),
        scheduler=SchedulerConfig(max_num_batched_tokens=v["max_num_batched_tokens"],
                                  max_num_seqs=v["max_num_seqs"], role=role),
        tensor_parallel_size=v.get("tensor_parallel_size", 1),
    )
