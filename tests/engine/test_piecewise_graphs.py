"""Piecewise graphs of steps with prefill rows (pdserve/piecewise_graphs.py), off CUDA: the
segments run eagerly over the same padded static buffers that a GPU replays, attention between
them. Against the eager forward: the same greedy tokens and logprobs through chunked prefills,
mixed steps and steps too large for the graphs; the layer hook sees each layer once its KV is
written; padding rows write no KV. The captured path itself: tests/engine/test_cuda_graphs_gpu.py."""

from __future__ import annotations

import os
import random

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.llm import LLM
from pdserve.piecewise_graphs import PiecewiseGraphs, capture_sizes
from pdserve.sampling_params import SamplingParams

LENGTHS = [5, 40, 77, 18, 3, 29]
MAX_TOKENS = [3, 9, 5, 12, 7, 4]


def _generate(max_tokens: int, model: str = "random:tiny-llama", kv_cache_dtype: str = "auto"):
    llm = LLM(model, device="cpu", dtype="float32", num_blocks=64, block_size=16,
              max_num_batched_tokens=32, max_num_seqs=8, overlap_steps=False, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    runner.prefill_graph_max_tokens = max_tokens  # off CUDA: the segments run eagerly
    eager_steps = []
    forward = runner.model.forward
    runner.model.forward = lambda *a, **kw: eager_steps.append(a[0].shape[0]) or forward(*a, **kw)
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in LENGTHS]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=2) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params)
    return outs, runner, eager_steps, llm


def _same(a, b, tol=1e-5):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx.token_id == ly.token_id
            assert lx.logprob == pytest.approx(ly.logprob, abs=tol)
            assert [t for t, _ in lx.top] == [t for t, _ in ly.top]


def test_capture_sizes_end_at_the_bound():
    assert capture_sizes(512)[-1] == 512 and capture_sizes(512)[:3] == [16, 32, 48]
    assert capture_sizes(40) == [16, 32, 40]
    assert capture_sizes(1) == [1]
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        capture_sizes(0)


@pytest.mark.parametrize("model,kv", [("random:tiny-llama", "auto"), ("random:tiny-qwen2", "auto"),
                                      ("random:tiny-tied", "auto"), ("random:tiny-llama", "fp8"),
                                      ("random:tiny-qwen3", "auto"), ("random:tiny-qwen3-moe", "auto"),
                                      ("random:tiny-olmoe", "auto")])
def test_piecewise_steps_give_the_eager_tokens_and_logprobs(model, kv):
    """Llama, Qwen2 (QKV bias), tied embeddings, an FP8 cache, and the kernels path of Qwen3's
    per-head and OLMoE's per-projection q/k norms (in place in the static QKV buffer) and of the
    sparse MLP."""
    eager, eager_runner, eager_steps, _ = _generate(0, model, kv)
    assert eager_runner._piecewise is None
    # 24 of the 32-token budget: full 32-token steps stay eager, the rest run in segments
    graphed, runner, steps, llm = _generate(24, model, kv)
    pw = runner._piecewise
    assert pw is not None and pw.num_runs > 0 and not pw.captured
    assert steps and all(n > 24 for n in steps)  # only what the graphs do not cover ran eagerly
    assert len(eager_steps) > len(steps)
    assert [len(o.token_ids) for o in graphed] == MAX_TOKENS
    _same(graphed, eager)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def _engine(max_tokens: int) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32",
                                    cache=CacheConfig(num_blocks=16),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    engine.runner.prefill_graph_max_tokens = max_tokens
    return engine


def _written_rows(cache: torch.Tensor) -> int:
    rows = cache.reshape(-1, cache.shape[-1])
    return int((rows != 0).any(-1).sum())


def test_the_layer_hook_sees_each_layer_once_its_kv_is_written_and_padding_writes_none():
    engine = _engine(64)
    runner = engine.runner
    prompt = list(range(2, 39))  # 37 tokens: padded to 48
    engine.add_request("a", prompt, SamplingParams(max_tokens=2))
    batch = engine.scheduler.schedule()
    kv_heads = runner.model_config.num_kv_heads
    num_layers = len(runner.kv_caches)
    seen = []

    def hook(layer):
        this = _written_rows(runner.kv_caches[layer][0])
        after = _written_rows(runner.kv_caches[layer + 1][0]) if layer + 1 < num_layers else 0
        seen.append((layer, this, after))

    logits = runner.execute(batch, hook)
    assert seen == [(i, len(prompt) * kv_heads, 0) for i in range(num_layers)]
    assert runner._piecewise.sizes[:3] == [16, 32, 48] and runner._piecewise.num_runs == 1
    for k, v in runner.kv_caches:  # the 11 padding rows wrote nothing
        assert _written_rows(k) == _written_rows(v) == len(prompt) * kv_heads

    eager = _engine(0)
    eager.add_request("a", prompt, SamplingParams(max_tokens=2))
    expected = eager.runner.execute(eager.scheduler.schedule())
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    for (k, v), (ek, ev) in zip(runner.kv_caches, eager.runner.kv_caches):
        torch.testing.assert_close(k, ek, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, ev, rtol=1e-5, atol=1e-5)


def test_a_step_outside_the_graphs_is_refused_by_them():
    engine = _engine(16)
    pw = engine.runner.prefill_graphs()
    assert pw.covers(16) and not pw.covers(17) and not pw.covers(0)
    with pytest.raises(ValueError, match="outside the prefill graphs"):
        pw.run(torch.zeros(17, dtype=torch.int64), None)  # type: ignore[arg-type]


def test_tensor_parallel_models_are_refused():
    engine = _engine(16)
    model = engine.runner.model
    model.comm = object()  # what a TP rank's model holds
    try:
        with pytest.raises(ValueError, match="tensor parallelism"):
            PiecewiseGraphs(model, engine.runner.kv_caches, 16, rotate_k=False)
    finally:
        model.comm = None


def test_the_cache_config_checks_its_bound_and_the_graphs_stay_off_the_cpu():
    """(--prefill-graphs and PDSERVE_PREFILL_GRAPHS: tests/engine/test_engine_switches.py)"""
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        CacheConfig(prefill_graph_max_tokens=0)
    engine = LLMEngine(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32",
                                    cache=CacheConfig(num_blocks=8, prefill_graphs=True)))
    assert engine.runner.prefill_graph_max_tokens == 0  # CUDA only
    assert engine.runner.capture_prefill_graphs() == 0.0


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="interprets the Triton kernels on CPU")
def test_piecewise_steps_with_the_triton_kernels_and_dense_prefill(monkeypatch):
    """The Triton path (interpreted): RoPE rotates k in the QKV buffer, which the dense
    attention of fresh prompts reads; later chunks take the paged kernel."""
    import importlib

    from pdserve.kernels import dispatch

    monkeypatch.setattr(dispatch, "_settings", dispatch.settings())  # the engines below set them: restored after

    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("PDSERVE_PREFILL_ATTENTION", "dense")
    pa = importlib.import_module("pdserve.kernels.prefill_attention")
    calls = {"dense": 0}
    real = pa.dense_prefill_attention_triton

    def counted(*args, **kw):
        calls["dense"] += 1
        return real(*args, **kw)

    monkeypatch.setattr(pa, "dense_prefill_attention_triton", counted)

    def run(max_tokens):
        llm = LLM("random:tiny-llama", device="cpu", dtype="float32", num_blocks=32,
                  max_num_batched_tokens=32, max_num_seqs=4, overlap_steps=False)
        runner = llm.engine.runner
        assert runner.dense_prefill and not runner.torch_path
        runner.prefill_graph_max_tokens = max_tokens
        rng = random.Random(4)
        prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in (21, 40)]
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
        return llm.generate(prompts, params), runner

    eager, _ = run(0)
    eager_dense, calls["dense"] = calls["dense"], 0
    graphed, runner = run(32)
    assert runner._piecewise.num_runs > 0 and runner._piecewise.rotate_k
    assert eager_dense > 0 and calls["dense"] == eager_dense
    _same(graphed, eager, tol=1e-4)


def test_the_benchmark_runs_both_modes_on_the_cpu(capsys):
    """benchmarks/bench_prefill_graphs.py, tiny: each point on and off, and each mode checked
    to have run the path it names (it raises otherwise)."""
    import importlib

    bench = importlib.import_module("benchmarks.bench_prefill_graphs")
    assert bench.main(["--prompts", "8", "40", "--batches", "2", "--chunks", "8", "--context", "24",
                       "--max-tokens", "32", "--repeats", "1", "--decode-steps", "2", "--num-blocks", "64"]) == 0
    out = capsys.readouterr().out
    assert "| 8 | " in out and "| 40 (over --max-tokens: eager both) |" in out and "| 2 + 8 | " in out
    assert "over 2 points" in out
    # every row: both times, their ratio, and the host's part of each (execute's return)
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
    assert len(rows) == 3
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        eager, graphs, host_eager, host_graphs = (float(cells[i]) for i in (1, 2, 4, 5))
        # the ratio of the unrounded times: within the rounding of the printed ones
        assert cells[3].endswith("x") and float(cells[3][:-1]) == pytest.approx(eager / graphs, rel=0.05, abs=0.01)
        assert 0 < host_eager <= eager * 1.5 and 0 < host_graphs <= graphs * 1.5
