"""`compile=True` (CacheConfig.compile_cpu_decode): decode-only steps on the CPU path run
`decode_forward_torch` through torch.compile. Same greedy tokens as the eager path for a batch
that mixes prefills and decodes and shrinks as requests finish (batch 1 and batch > 1
graphs, contexts growing across blocks), for a model with QKV bias; blocks all come back."""

from __future__ import annotations

import random

import pytest

from pdserve import kernels

from pdserve.engine_args import engine_config
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

LENGTHS = [5, 40, 77, 18]
MAX_TOKENS = [3, 25, 9, 12]


def _run(compile: bool, packed_weights: bool = True, seed: int = 5):
    llm = LLM("random:tiny-qwen2", device="cpu", dtype="float32", num_blocks=64, block_size=16,
              max_num_batched_tokens=32, max_num_seqs=8, compile=compile, packed_weights=packed_weights)
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in LENGTHS]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], llm


@pytest.mark.slow  # torch.compile on the CPU, an option off by default: ~30 s of compiling
def test_compiled_decode_matches_eager_tokens():
    eager, eager_llm = _run(False)
    compiled, llm = _run(True)
    assert eager_llm.engine.runner.num_compiled_steps == 0
    assert llm.engine.runner.num_compiled_steps > 0
    assert [len(t) for t in compiled] == MAX_TOKENS
    assert compiled == eager
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_compile_flag_reaches_the_cache_config():
    values = {"model": "smollm2", "dtype": None, "device": None, "max_model_len": None, "kv_cache_gib": 0.5,
              "gpu_memory_fraction": 0.85, "block_size": 16, "max_num_batched_tokens": 512, "max_num_seqs": 8,
              "no_prefix_caching": False, "compile": True}
    assert engine_config(values).cache.compile_cpu_decode is True
    assert engine_config({**values, "compile": False}).cache.compile_cpu_decode is False


def test_packed_weights_default_on_cpu_fp32_same_tokens():
    """CPU fp32 engines pack their projections and LM head (pdserve/kernels/linear.py) unless told not
    to; the greedy tokens are the same either way."""
    packed, packed_llm = _run(False, packed_weights=True, seed=7)
    dense, dense_llm = _run(False, packed_weights=False, seed=7)
    assert packed_llm.engine.runner.model.packed_weights
    assert not dense_llm.engine.runner.model.packed_weights
    assert isinstance(packed_llm.engine.runner.model.layers[0].qkv_proj, kernels.PackedWeight)
    assert packed == dense
    bf16 = LLM("random:tiny-qwen2", device="cpu", dtype="bfloat16", num_blocks=8)
    assert not bf16.engine.runner.model.packed_weights  # MKL packs fp32 only


def test_no_packed_weights_flag_reaches_the_cache_config():
    values = {"model": "smollm2", "dtype": None, "device": None, "max_model_len": None, "kv_cache_gib": 0.5,
              "gpu_memory_fraction": 0.85, "block_size": 16, "max_num_batched_tokens": 512, "max_num_seqs": 8,
              "no_prefix_caching": False}
    assert engine_config(values).cache.cpu_packed_weights is True
    assert engine_config({**values, "no_packed_weights": True}).cache.cpu_packed_weights is False
