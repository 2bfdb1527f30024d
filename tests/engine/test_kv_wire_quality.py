"""FP8 on the KV wire against full precision on real weights (SmolLM2, the embedded GGUF, float32
on the CPU): benchmarks/kv_wire_quality.py's measurement at a small size.

4 prompts, 16 greedy tokens, teacher-forced with the prompt's KV through the FP8 round trip that
the KV plane runs (kernels.kv_codec.pack_blocks / unpack_blocks). Tolerance: the same argmax at
>= 95% of the 60 positions compared (at most 3 flips: a flip happens only at a near tie, and 60
positions are too few to hold the benchmark's 99% without flaking on one tie); the mean drift of
the continuation's log-probability below 0.1 nats (0.018 measured on 2 prompts). The teacher-forced
reference must reproduce the engine's own greedy tokens (>= 95%: batched generation and one
prefill round differently), or the comparison would not be of the same continuation."""

from __future__ import annotations

import importlib

import pytest

from pdserve.llm import LLM


def _bench():
    return importlib.import_module("benchmarks.kv_wire_quality")


@pytest.mark.timeout(900)
def test_fp8_wire_keeps_smollm2_greedy_argmax():
    bench = _bench()
    llm = LLM("smollm2", dtype="float32", device="cpu", kv_cache_gib=0.1, enable_prefix_caching=False)
    try:
        result = bench.compare(llm, bench.prompts(4), 16)
    finally:
        llm.close()
    assert result["positions"] == 4 * 15
    assert result["reference_equals_generated"] >= 0.95, result
    assert result["argmax_agreement"] >= 0.95, result
    assert 0 < result["logprob_drift_mean"] < 0.1, result
    assert result["logprob_drift_max"] >= result["logprob_drift_mean"]
