"""CUDA graph replay of decode steps against eager execution, on the GPU."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

LENGTHS = [5, 40, 77, 130, 300, 17]
MAX_TOKENS = [3, 17, 9, 33, 20, 40]


def _generate(monkeypatch, graphs: bool, dtype: str):
    llm = LLM("random:smollm2-135m", device="cuda", dtype=dtype, num_blocks=256,
              max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=not graphs)
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 40000) for _ in range(n)] for n in LENGTHS]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], llm


def test_graph_replay_gives_eager_greedy_tokens_fp32(monkeypatch):
    # fp32 (IEEE dots in the kernels, no TF32 in cuBLAS): padding the batch changes nothing
    # but rounding at the 1e-6 level, so greedy tokens must agree exactly.
    eager, eager_llm = _generate(monkeypatch, False, "float32")
    assert eager_llm.engine.runner.num_graph_replays == 0
    del eager_llm
    graphed, llm = _generate(monkeypatch, True, "float32")
    runner = llm.engine.runner
    assert runner.num_graph_replays > 0
    assert sorted(runner.decode_graphs._graphs) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert [len(t) for t in graphed] == MAX_TOKENS
    assert graphed == eager
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_graph_replay_logits_match_eager_bf16(monkeypatch):
    """The same decode step through a captured graph and eagerly: bf16 logits agree."""
    llm = LLM("random:smollm2-135m", device="cuda", dtype="bfloat16", num_blocks=256,
              max_num_batched_tokens=512, max_num_seqs=8)
    engine = llm.engine
    rng = random.Random(7)
    for i, n in enumerate([33, 70, 16]):
        engine.add_request(f"r{i}", [rng.randrange(10, 40000) for _ in range(n)],
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # prefill all three
    batch = engine.scheduler.schedule()
    runner = engine.runner
    assert runner.is_decode_only(batch) and len(batch) == 3
    graphed = runner.execute(batch).clone()
    input_ids, meta = runner.prepare(batch)
    eager = runner.model(input_ids, meta, runner.kv_caches)
    assert runner.num_graph_replays == 1
    scale = eager.abs().max()
    torch.testing.assert_close(graphed, eager, rtol=0.02, atol=0.02 * scale)


def _prefill_graph_run(graphs: bool, dtype: str, layer_hook=None):
    """Prompts long and short through 64-token steps (chunked prefills, mixed steps): with the
    piecewise prefill graphs (captured first, as the warm-up does) or eagerly."""
    llm = LLM("random:smollm2-135m", device="cuda", dtype=dtype, num_blocks=256,
              max_num_batched_tokens=64, max_num_seqs=8, prefill_graphs=graphs)
    runner = llm.engine.runner
    if graphs:
        assert runner.prefill_graph_max_tokens == 64  # 512 by default, capped by the token budget
        assert runner.capture_prefill_graphs() > 0 and runner.prefill_graphs().captured
        assert runner.prefill_graphs().sizes == [16, 32, 48, 64]
    else:
        assert runner.prefill_graph_max_tokens == 0
    rng = random.Random(9)
    prompts = [[rng.randrange(10, 40000) for _ in range(n)] for n in LENGTHS]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params)
    return outs, llm


def test_prefill_graphs_give_eager_greedy_tokens_fp32():
    """fp32: padding a step to its capture size changes rounding at the 1e-6 level at most."""
    eager, eager_llm = _prefill_graph_run(False, "float32")
    assert eager_llm.engine.runner._piecewise is None
    del eager_llm
    graphed, llm = _prefill_graph_run(True, "float32")
    pw = llm.engine.runner._piecewise
    assert pw.num_runs > 0
    assert [len(o.token_ids) for o in graphed] == MAX_TOKENS
    for g, e in zip(graphed, eager):
        assert g.token_ids == e.token_ids
        for lg, le in zip(g.logprobs, e.logprobs):
            assert lg.logprob == pytest.approx(le.logprob, abs=1e-3)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prefill_graph_step_logits_and_kv_match_eager_bf16():
    """One fresh 100-token prompt (padded to 128) with a layer hook, replayed and eager: the
    same logits and the same KV in every layer; the hook sees every layer in order."""
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import LLMEngine

    def engine(graphs):
        return LLMEngine(EngineConfig(model="random:smollm2-135m", device="cuda", dtype="bfloat16",
                                      cache=CacheConfig(num_blocks=64, prefill_graphs=graphs),
                                      scheduler=SchedulerConfig(max_num_batched_tokens=512)))

    rng = random.Random(2)
    prompt = [rng.randrange(10, 40000) for _ in range(100)]
    results = []
    for graphs in (False, True):
        e = engine(graphs)
        e.runner.capture_prefill_graphs()
        e.add_request("a", prompt, SamplingParams(max_tokens=2))
        seen = []
        logits = e.runner.execute(e.scheduler.schedule(), seen.append).float()
        torch.cuda.synchronize()
        assert seen == list(range(len(e.runner.kv_caches)))
        results.append((logits, [(k.float().clone(), v.float().clone()) for k, v in e.runner.kv_caches]))
        if graphs:
            assert e.runner._piecewise.captured and e.runner._piecewise.num_runs == 1
        del e
    (eager, eager_kv), (graphed, graphed_kv) = results
    scale = eager.abs().max()
    torch.testing.assert_close(graphed, eager, rtol=0.02, atol=0.02 * scale)
    for (k, v), (ek, ev) in zip(graphed_kv, eager_kv):
        torch.testing.assert_close(k, ek, rtol=0.02, atol=0.02)
        torch.testing.assert_close(v, ev, rtol=0.02, atol=0.02)
