"""The engine's fresh-prompt attention (kernels.prefill_attention_dense) against its paged
attention, end to end on a tiny random Llama: the Triton kernels interpreted on CPU, with
chunked prefill (later chunks have a cached prefix: paged), a prefix-cache hit (paged) and
steps that mix decodes with fresh prompts (dense)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from pdserve.kernels import dispatch
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

from .test_model_vs_transformers import prompts

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interprets the Triton kernels on CPU (the GPU path: test_model_gpu.py)")


@pytest.fixture(autouse=True)
def kernel_settings_restored(monkeypatch):
    """The engines here set the process's kernel settings from the variables when they start
    (EngineConfig.kernels None): as they were again after each test."""
    monkeypatch.setattr(dispatch, "_settings", dispatch.settings())


def run(path: str, monkeypatch, mode: str, batch: list[list[int]]):
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("PDSERVE_PREFILL_ATTENTION", mode)
    llm = LLM(path, dtype="float32", device="cpu", num_blocks=64, max_num_batched_tokens=48,
              overlap_steps=False)
    calls = {"dense": 0}
    pa = importlib.import_module("pdserve.kernels.prefill_attention")  # the package exports a function of that name

    real = pa.dense_prefill_attention_triton

    def counted(*args, **kw):
        calls["dense"] += 1
        return real(*args, **kw)

    monkeypatch.setattr(pa, "dense_prefill_attention_triton", counted)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate(batch, params)
    llm.close()
    return outs, calls["dense"]


def test_dense_prefill_matches_paged(hf_models, monkeypatch):
    _, path = hf_models["llama"]
    batch = prompts(3, seed=5, lo=20, hi=40)
    batch.append(batch[0][:30] + [7, 8, 9])  # shares a cached prefix with the first prompt
    paged, paged_calls = run(path, monkeypatch, "paged", batch)
    dense, dense_calls = run(path, monkeypatch, "dense", batch)
    assert paged_calls == 0 and dense_calls > 0
    for p, d in zip(paged, dense):
        assert p.token_ids == d.token_ids
        assert len(p.logprobs) == len(d.logprobs) == 4
        for lp, ld in zip(p.logprobs, d.logprobs):
            assert lp.token_id == ld.token_id
            assert lp.logprob == pytest.approx(ld.logprob, abs=1e-4)


def test_warm_up_compiles_the_paged_kernel_when_fresh_prompts_skip_it(monkeypatch):
    """With the dense path on, the warm-up's requests (all fresh prompts) never run the paged
    prefill kernel: it is run directly, at this engine's heads, head_dim, block size and dtype."""
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.warmup import _warm_paged_prefill

    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")

    def engine(mode):
        monkeypatch.setenv("PDSERVE_PREFILL_ATTENTION", mode)
        return LLMEngine(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32",
                                      cache=CacheConfig(num_blocks=8),
                                      scheduler=SchedulerConfig(max_num_batched_tokens=32)))

    pa = importlib.import_module("pdserve.kernels.prefill_attention")
    seen = []
    real = pa.prefill_attention_triton
    monkeypatch.setattr(pa, "prefill_attention_triton",
                        lambda q, kc, *a, **kw: seen.append((q.shape[1:], kc.shape[1:], q.dtype, kw["config"]))
                        or real(q, kc, *a, **kw))
    paged = engine("paged")
    assert not paged.runner.dense_prefill
    assert _warm_paged_prefill(paged) == [] and seen == []  # the requests cover the paged kernel
    dense = engine("dense")
    assert dense.runner.dense_prefill
    assert _warm_paged_prefill(dense) == [(16, 16, 4, 1)]
    c = dense.runner.model.config
    assert seen == [((c.num_heads, c.head_dim), (dense.runner.block_size, c.num_kv_heads, c.head_dim),
                     torch.float32, (16, 16, 4, 1))]
    with pytest.raises(ValueError, match="PDSERVE_PREFILL_ATTENTION must be auto, dense or paged; got 'flash'"):
        engine("flash")  # named at start-up, not at the first prefill
