"""Choose between the Triton kernels and their torch references.

Order of precedence:
1. a backend forced with `force_backend(...)` (tests, benchmarks);
2. the process's backend, set once by whoever starts the engine (`configure`, from
   `EngineConfig.kernels`: the CLI reads it from PDSERVE_KERNEL_BACKEND) in {auto, torch, triton};
3. auto: "triton" when the tensor lives on CUDA and `triton` imports, else "torch".

The torch references are also the production path on CPU, so "auto" on a CPU tensor is
always "torch". Forcing "triton" on a CPU tensor only works under `TRITON_INTERPRET=1`.
The kernels read no environment variable of ours: `configure` is how their settings arrive.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

Backend = Literal["triton", "torch"]

_CHOICES = ("auto", "torch", "triton")
PREFILL_ATTENTION_MODES = ("auto", "dense", "paged")  # kernels.prefill_attention.dense_applies

_forced: contextvars.ContextVar[Backend | None] = contextvars.ContextVar(
    "pdserve_forced_kernel_backend", default=None
)


@dataclass(frozen=True)
class KernelSettings:
    """The process's kernel settings (`configure`)."""

    backend: str = "auto"  # one of _CHOICES
    prefill_attention: str = "auto"  # one of PREFILL_ATTENTION_MODES


_settings = KernelSettings()


@functools.cache
def triton_available() -> bool:
    """True when the `triton` package is installed (checked once, without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _check_choice(value: str, source: str) -> str:
    choice = value.strip().lower()
    if choice not in _CHOICES:
        raise ValueError(f"{source} must be one of {', '.join(_CHOICES)}; got {value!r}")
    return choice


def configure(backend: str = "auto", prefill_attention: str = "auto") -> None:
    """Sets this process's kernel settings: its backend ("auto", "torch" or "triton") and the
    attention of fresh prompts ("auto", "dense" or "paged": `prefill_attention.dense_applies`).
    Whoever starts an engine calls it once, before the engine's first kernel (LLMEngine, from
    EngineConfig.kernels; each tensor-parallel rank). ValueError naming a bad value."""
    global _settings
    mode = prefill_attention.strip().lower()
    if mode not in PREFILL_ATTENTION_MODES:
        raise ValueError(f"prefill attention must be auto, dense or paged; got {prefill_attention!r}")
    _settings = KernelSettings(_check_choice(backend, "kernel backend"), mode)


def settings() -> KernelSettings:
    """This process's kernel settings (`configure`; all "auto" until it is called)."""
    return _settings


def kernel_backend(device: torch.device | str) -> Backend:
    """The backend that kernels run for tensors on `device`."""
    forced = _forced.get()
    choice: str = forced if forced is not None else _settings.backend
    if choice == "auto":
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
        is_cuda = kind == "cuda"
        return "triton" if is_cuda and triton_available() else "torch"
    if choice == "triton" and not triton_available():
        raise RuntimeError("kernel backend 'triton' was requested (PDSERVE_KERNEL_BACKEND, configure or "
                           "force_backend) but the triton package is not installed")
    return choice  # type: ignore[return-value]


@contextlib.contextmanager
def force_backend(backend: str) -> Iterator[None]:
    """Run the enclosed block with every kernel on `backend` ("torch", "triton" or "auto")."""
    choice = _check_choice(backend, "force_backend(backend)")
    token = _forced.set(None if choice == "auto" else choice)  # type: ignore[arg-type]
    try:
        yield
    finally:
        _forced.reset(token)
