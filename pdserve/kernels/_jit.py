"""Lazy Triton JIT shared by the kernel files.

Kernels are written as plain module-level functions that use the module global `tl` and
string annotations (`from __future__ import annotations`, so `tl.constexpr` needs no import).
`TritonKernels.get` imports triton on the first launch, binds `tl` in the kernel module and
wraps every listed function with `triton.jit`, replacing the module global so that kernels
calling each other see JIT functions.

A helper defined in one kernel module and used by another (`from pdserve.kernels.rope import
_rope_rotate`) is bound where it is defined: its name is resolved, and its annotations and
body read `tl`, in its own module's globals. So a loader never wraps a foreign function
itself: it loads the defining module's loader first (every loader registers itself by module
name) and takes the JIT object from there. Whichever kernel module launches first in a fresh
process, every function it reaches is bound, and a helper is wrapped exactly once.
Three consequences:

* `import pdserve.kernels` works without triton installed and costs nothing when triton is unused;
* load order does not matter (tests/kernels/test_kernel_load_order.py runs each entry point
  first in its own interpreter);
* `TRITON_INTERPRET` is read at the first launch, not at import, so a test conftest may set
  it after some other module imported `kernels`.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from typing import Any

# Every kernel module's loader, by module name; one lock for all loads, since loading one
# module may load another (a shared helper) and two threads may start from either end.
_LOADERS: dict[str, TritonKernels] = {}
_LOAD_LOCK = threading.RLock()


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
        self._module = module_globals["__name__"]
        self._names = names
        self._do_not_specialize = do_not_specialize or {}
        self._loaded = False
        _LOADERS[self._module] = self

    def get(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(f"{name} is not a registered kernel of {self._module}")
        if not self._loaded:
            self.load()
        return self._globals[name]

    def load(self) -> None:
        """Binds `tl` and JIT-wraps every listed function (idempotent, thread-safe)."""
        with _LOAD_LOCK:
            if not self._loaded:
                self._load()

    def _load(self) -> None:
        try:
            import triton
            import triton.language as tl
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError("the triton kernel backend needs the triton package; "
                               "install pdserve[triton] or use PDSERVE_KERNEL_BACKEND=torch") from exc
        self._globals["tl"] = tl
        for name in self._names:
            fn = self._globals[name]
            if not inspect.isfunction(fn):
                continue  # already bound: the defining module's JIT object
            home = fn.__module__
            if home != self._module:
                self._globals[name] = _bound_in(home, name)
                continue
            keep_generic = self._do_not_specialize.get(name)
            if keep_generic:
                self._globals[name] = triton.jit(fn, do_not_specialize=list(keep_generic))
            else:
                self._globals[name] = triton.jit(fn)
        self._loaded = True


def _bound_in(module_name: str, name: str) -> Any:
    """The JIT object of helper `name` as its defining kernel module binds it."""
    loader = _LOADERS.get(module_name)
    if loader is None:
        importlib.import_module(module_name)  # its TritonKernels registers on import
        loader = _LOADERS.get(module_name)
    if loader is None or name not in loader._names:
        raise RuntimeError(f"{name} comes from {module_name}, which does not list it as a "
                           "Triton function: add it to that module's TritonKernels")
    loader.load()
    return loader._globals[name]


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
