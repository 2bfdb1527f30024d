"""Choose between the Triton kernels and their torch references.

Order of precedence:
1. a backend forced with `force_backend(...)` (tests, benchmarks);
2. the environment variable `PDSERVE_KERNEL_BACKEND` in {auto, torch, triton};
3. auto: "triton" when the tensor lives on CUDA and `triton` imports, else "torch".

The torch references are also the production path on CPU, so "auto" on a CPU tensor is
always "torch". Forcing "triton" on a CPU tensor only works under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from collections.abc import Iterator
from typing import Literal

import torch

Backend = Literal["triton", "torch"]

ENV_VAR = "PDSERVE_KERNEL_BACKEND"
_CHOICES = ("auto", "torch", "triton")

_forced: contextvars.ContextVar[Backend | None] = contextvars.ContextVar(
    "pdserve_forced_kernel_backend", default=None
)


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


@functools.lru_cache(maxsize=8)
def _env_choice(value: str) -> str:
    return _check_choice(value, ENV_VAR)


def kernel_backend(device: torch.device | str) -> Backend:
    """The backend that kernels run for tensors on `device`."""
    forced = _forced.get()
    if forced is not None:
        choice: str = forced
    else:
        choice = _env_choice(os.environ.get(ENV_VAR, "auto"))
    if choice == "auto":
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
        is_cuda = kind == "cuda"
        return "triton" if is_cuda and triton_available() else "torch"
    if choice == "triton" and not triton_available():
        raise RuntimeError(f"kernel backend 'triton' was requested ({ENV_VAR} or force_backend) "
                           "but the triton package is not installed")
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
