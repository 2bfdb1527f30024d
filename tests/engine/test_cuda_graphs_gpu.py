"""CUDA graph replay of decode steps against eager execution, on the GPU."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

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
    assert sorted(runner._graphs) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
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
