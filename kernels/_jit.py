"""Lazy Triton JIT shared by the kernel files.

Kernels are written as plain module-level functions that use the module global `tl` and
string annotations (`from __future__ import annotations`, so `tl.constexpr` needs no import).
`TritonKernels.get` imports triton on the first launch, binds `tl` in the kernel module and
wraps every listed function with `triton.jit`, replacing the module global so that kernels
calling each other see JIT functions. Two consequences:

* `import kernels` works without triton installed and costs nothing when triton is unused;
* `TRITON_INTERPRET` is read at the first launch, not at import, so a test conftest may set
  it after some other module imported `kernels`.
"""

from __future__ import annotations

import threading
from typing import Any


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TritonKernels:
    """`do_not_specialize` maps a kernel name to integer arguments that vary from call to call
    (batch counts, block table strides, split counts): Triton then compiles one variant instead
    of one per value class (== 1, % 16 == 0, other), so a serving engine never stalls on a
    fresh compilation when its batch shape changes."""

    def __init__(self, module_globals: dict[str, Any], *names: str,
                 do_not_specialize: dict[str, tuple[str, ...]] | None = None) -> None:
        self._globals = module_globals
        self._names = names
        self._do_not_specialize = do_not_specialize or {}
        self._lock = threading.Lock()
        self._loaded = False

    def get(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(f"{name} is not a registered kernel of {self._globals['__name__']}")
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    self._load()
        return self._globals[name]

    def _load(self) -> None:
        try:
            import triton
            import triton.language as tl
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError("the triton kernel backend needs the triton package; "
                               "install pdserve[triton] or use PDSERVE_KERNEL_BACKEND=torch") from exc
        self._globals["tl"] = tl
        for name in self._names:
            if isinstance(self._globals[name], triton.runtime.JITFunction):
                continue  # a helper imported from a kernel file that loaded first
            keep_generic = self._do_not_specialize.get(name)
            if keep_generic:
                self._globals[name] = triton.jit(self._globals[name], do_not_specialize=list(keep_generic))
            else:
                self._globals[name] = triton.jit(self._globals[name])
        self._loaded = True


def check_tensor(name: str, t: Any, ndim: int, dtypes: tuple | None = None,
                 contiguous: bool = False, last_dim_contiguous: bool = True) -> None:
    """Raise ValueError unless `t` is a tensor of `ndim` dims with an allowed dtype/layout."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {dtypes}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if last_dim_contiguous and t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"triton kernels need a power-of-two head_dim >= 16, got {head_dim}")
