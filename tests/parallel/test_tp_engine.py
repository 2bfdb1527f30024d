"""TP=2 and TP=3 engines (local processes, gloo) against TP=1: logits, greedy tokens, text.

Each TP engine is rank 0 in this process and N - 1 spawned processes; every test closes it.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# a long prompt is prefilled in chunks beside the others' decodes (max_num_batched_tokens=24)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 70)), [300, 5, 300, 5]]
ENGINE = dict(device="cpu", num_blocks=48, block_size=8, max_num_batched_tokens=24)


def run_recording(llm: LLM, prompts, params) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of each prompt and the logits of every step (rank 0's, gathered)."""
    runner = llm.engine.runner
    logits: list[torch.Tensor] = []
    execute = runner.execute

    def recording(*args, **kwargs):
        out = execute(*args, **kwargs)
        logits.append(out.clone())
        return out

    runner.execute = recording
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        runner.execute = execute
    return tokens, logits


@pytest.fixture(scope="module")
def reference():
    """TP=1 tokens and logits, per model."""
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = run_recording(LLM(model, **ENGINE), PROMPTS, GREEDY)
        return cache[model]
    return get


@pytest.mark.parametrize("model, size", [
    ("random:tiny-llama-tp", 2), ("random:tiny-llama-tp", 3),
    ("random:tiny-qwen2-tp", 2), ("random:tiny-qwen2-tp", 3),
    ("random:tiny-mistral-tp", 2), ("random:tiny-mistral-tp", 3),
    ("random:tiny-llama", 2),
])
def test_logits_and_greedy_tokens_equal_tp1(reference, model, size):
    ref_tokens, ref_logits = reference(model)
    with LLM(model, tensor_parallel_size=size, **ENGINE) as llm:
        assert llm.engine.runner.model_config.num_heads == llm.engine.model_config.num_heads // size
        tokens, logits = run_recording(llm, PROMPTS, GREEDY)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert len(logits) == len(ref_logits) >= 6
        for ours, ref in zip(logits, ref_logits):
            assert ours.shape == ref.shape
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens
    assert not multiprocessing.active_children()  # close() stopped the other ranks


def test_graph_path_steps_are_published_too(reference):
    """Decode-only steps through the graph path's static buffers (off CUDA: replayed eagerly):
    rank 0 publishes ("capture",) and each step's buffer contents; the others run them."""
    model = "random:tiny-qwen2-tp"
    ref_tokens, _ = reference(model)
    with LLM(model, tensor_parallel_size=2, **ENGINE) as llm:
        llm.engine.runner.use_cuda_graphs = True
        tokens, _ = run_recording(llm, PROMPTS, GREEDY)
        assert llm.engine.runner.num_graph_replays > 0
    assert tokens == ref_tokens


def test_hf_safetensors_model_at_tp2(hf_models):
    _, path = hf_models["qwen2"]  # 6 heads, 2 KV heads, biases
    ref, _ = run_recording(LLM(path, **ENGINE), PROMPTS, GREEDY)
    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        tokens, _ = run_recording(llm, PROMPTS, GREEDY)
    assert tokens == ref


SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
                "The quick brown fox", "Water boils at", "My favourite colour is", "import numpy as"]


@pytest.mark.slow  # the tiny models' logits at TP 2 and 3 run in the default suite
def test_smollm2_tp3_gives_the_tp1_greedy_text():
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine = dict(device="cpu", dtype="float32", kv_cache_gib=0.02)
    ref = [o.text for o in LLM("smollm2", **engine).generate(SMOL_PROMPTS, params)]
    with LLM("smollm2", tensor_parallel_size=3, **engine) as llm:
        assert (llm.engine.runner.model_config.num_heads, llm.engine.runner.model_config.num_kv_heads) == (3, 1)
        texts = [o.text for o in llm.generate(SMOL_PROMPTS, params)]
    assert texts == ref
    assert "Paris" in texts[0]
