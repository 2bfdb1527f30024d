"""Profiles for simulated GPU clusters, derived from measured figures and labelled as such.

No `pdserve profile` of an 8B or 70B model on a GPU is committed, so these are built from
what the repository did measure in one run of benchmarks/bench_engine_gpu.py
(`random:llama-3.1-8b` bf16, docs/results/h100_engine.json; its machine and figures: docs/history.md,
the earlier session's table): the TTFT of a 2,048- and an 8,192-token prompt and the batch-1 decode
step, plus the device-copy bandwidth of the same run to price the KV a decode step reads. The
constants below are those figures. A 1-token prefill is taken as one decode step.

- `llama8b_h100()`: decode(b, c) = step + b x c x KV bytes per token / copy bandwidth; prefill
  through (1, step) and the two TTFTs, linear between.
- `llama70b_h100_tp4()`: a 70B-sized model on a worker of 4 GPUs of that kind: the 8B times
  x 70.6/8.03/4 (parameters, ideal tensor parallelism), 80 layers, 327,680 B/token of KV (80
  layers x 8 KV heads x 128 x 2 x bf16).
"""

from __future__ import annotations

from pdserve.router.placement.profiles import Profile

H100_TTFT = ((2048, 0.0535067980000008), (8192, 0.24465083200000493))
H100_DECODE_STEP_S = 1 / 152.54223174141433
H100_COPY_BYTES_S = 3004.0046911533236e9
LLAMA8B_KV_BYTES = 32 * 8 * 128 * 2 * 2
LLAMA70B_KV_BYTES = 80 * 8 * 128 * 2 * 2
_BATCHES = (1, 8, 32, 64, 128, 256)
_CONTEXTS = (128, 1024, 4096, 16384)


def _profile(model: str, hardware: str, time_factor: float, kv_bytes: int, num_layers: int,
             max_num_batched_tokens: int) -> Profile:
    step = H100_DECODE_STEP_S * time_factor
    prefill = ((1, step),) + tuple((n, t * time_factor) for n, t in H100_TTFT)
    decode = tuple(tuple(step + b * c * kv_bytes / H100_COPY_BYTES_S * time_factor for c in _CONTEXTS)
                   for b in _BATCHES)
    return Profile(
        hardware=hardware, device="cuda", model=model, dtype="bfloat16", num_layers=num_layers,
        kv_bytes_per_token=kv_bytes, block_size=16, max_num_batched_tokens=max_num_batched_tokens,
        prefill_tokens=tuple(n for n, _ in prefill), prefill_times=tuple(t for _, t in prefill),
        decode_batch_sizes=_BATCHES, decode_contexts=_CONTEXTS, decode_times=decode,
        created="derived from docs/results/h100_engine.json",
    )


def llama8b_h100(max_num_batched_tokens: int = 8192) -> Profile:
    return _profile("llama-3.1-8b-sized (derived from H100 figures, not profiled)", "NVIDIA H100 80GB HBM3",
                    1.0, LLAMA8B_KV_BYTES, 32, max_num_batched_tokens)


def llama70b_h100_tp4(max_num_batched_tokens: int = 8192) -> Profile:
    return _profile("llama-3.1-70b-sized (8B H100 figures scaled x70.6/8.03/4, not profiled)",
                    "4x NVIDIA H100 80GB HBM3 (assumed ideal TP)", 70.6 / 8.03 / 4, LLAMA70B_KV_BYTES, 80,
                    max_num_batched_tokens)
