"""Linear layers on the CPU path, with weights optionally in MKL's packed GEMM layout.

A dense fp32 GEMM on the CPU packs panels of the weight into the blocked layout its
micro-kernel reads, on every call. At decode sizes (M = running requests, 1 to a few dozen)
that repacking is a large share of the call, so weights packed once at load (`cblas_sgemm_pack`
through torch's `mkl._mkl_reorder_linear_weight`) are faster at M=4..16, a little slower at
M=1-2 (MKL's packed path is no faster for a matrix-vector product), and slower from M ~ 256 up,
where the dense path's own packing pays off; a whole prefill costs about the dense time. The
figures (`benchmarks/bench_cpu_ops.py`, `bench_engine_cpu.py`): docs/results.md, "Benchmarks"
(the CPU table) and "Figures behind the code's choices".

The packed copy is the same size as the dense one and replaces it (`PackedWeight`); MKL's
packed layout of a weight does not depend on M (`_mkl_reorder_linear_weight` gives the same
buffer for every batch-size hint), so one copy serves every batch. torch's `_mkl_linear`
takes the dense weight only for its shape and for a fallback at other M; `linear` always
passes the real M, and a storage-less expanded tensor carries the shape.
"""

from __future__ import annotations

import torch

# The batch-size hint MKL is given when packing (the layout is the same for any hint).
PACK_BATCH_HINT = 16


def packing_available() -> bool:
    """Whether this torch build can pack fp32 weights for MKL's GEMM."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        torch.ops.mkl._mkl_reorder_linear_weight
        torch.ops.mkl._mkl_linear
    except (AttributeError, RuntimeError):
        return False
    return True


class PackedWeight:
    """An fp32 CPU weight [out_features, in_features] in MKL's packed GEMM layout."""

    __slots__ = ("packed", "shape_of")

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"PackedWeight takes a 2-D float32 CPU weight, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        if not packing_available():
            raise ValueError("this torch build has no MKL packed GEMM")
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
        self.shape_of = weight.new_empty(()).expand(weight.shape)  # shape and dtype only, no storage

    @property
    def shape(self) -> torch.Size:
        return self.shape_of.shape


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear`, also for a `PackedWeight`."""
    if not isinstance(weight, PackedWeight):
        return torch.nn.functional.linear(x, weight, bias)
    n, k = weight.shape_of.shape
    rows = x.reshape(-1, k).contiguous()  # no copy when already contiguous
    if torch.compiler.is_compiling():  # inductor lowers _mkl_linear only for frozen constants
        out = torch.ops.pdserve.packed_linear(rows, weight.packed, weight.shape_of, bias)
    else:
        out = torch.ops.mkl._mkl_linear(rows, weight.packed, weight.shape_of, bias, rows.shape[0])
    return out.view(*x.shape[:-1], n)


# `_mkl_linear` as an opaque op for torch.compile graphs, where packed weights are graph inputs
# (inductor's own lowering of it takes frozen constants only). Registered through
# `torch.library.Library` rather than `custom_op`: a third of the per-call overhead.
_LIB = torch.library.Library("pdserve", "DEF")
_LIB.define("packed_linear(Tensor rows, Tensor packed, Tensor shape_of, Tensor? bias) -> Tensor")


def _packed_linear_impl(rows, packed, shape_of, bias):
    return torch.ops.mkl._mkl_linear(rows, packed, shape_of, bias, rows.shape[0])


_LIB.impl("packed_linear", _packed_linear_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::packed_linear")
def _packed_linear_fake(rows, packed, shape_of, bias):
    return rows.new_empty(rows.shape[0], shape_of.shape[0])
