"""Triton kernels and their torch references, dispatched by device (see kernels.dispatch).

Each public function runs `<name>_triton` or `<name>_ref` from its family module according to
`kernel_backend(tensor.device)`. Triton is imported only when a Triton kernel first runs.
"""

from pdserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from pdserve.kernels.cache import write_kv_cache, write_kv_cache_ref
from pdserve.kernels.decode_attention import decode_attention, decode_attention_planned, decode_gather_plan
from pdserve.kernels.dispatch import force_backend, kernel_backend
from pdserve.kernels.kv_quant import FP8_DTYPE, fp8_pool_shape, kv_cache_torch_dtype
from pdserve.kernels.linear import PackedWeight, linear, packing_available
from pdserve.kernels.norm import rms_norm, rms_norm_ref
from pdserve.kernels.prefill_attention import dense_applies as prefill_dense_applies
from pdserve.kernels.prefill_attention import prefill_attention
from pdserve.kernels.rope import apply_rope, apply_rope_tables, rope_cos_sin_cache, rope_tables
from pdserve.kernels.rope_cache import rope_write_kv

__all__ = [
    "apply_rope",
    "apply_rope_tables",
    "decode_attention_planned",
    "decode_gather_plan",
    "rope_tables",
    "decode_attention",
    "force_backend",
    "FP8_DTYPE",
    "fp8_pool_shape",
    "kv_cache_torch_dtype",
    "kernel_backend",
    "linear",
    "packing_available",
    "PackedWeight",
    "prefill_attention",
    "prefill_dense_applies",
    "rms_norm",
    "rms_norm_ref",
    "rope_cos_sin_cache",
    "rope_write_kv",
    "silu_and_mul",
    "silu_and_mul_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]
