"""The engine against transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

from .conftest import FAMILIES, LLAMA_FAMILIES

GREEDY = dict(temperature=0.0, ignore_eos=True)


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits that chose them ([steps, vocab]), recomputed in full each step."""
    ids = list(prompt)
    logits = []
    with torch.no_grad():
        for _ in range(steps):
            out = model(torch.tensor([ids])).logits[0, -1].float()
            logits.append(out)
            ids.append(int(out.argmax()))
    return ids[len(prompt):], torch.stack(logits)


def make_llm(path: str, **kw) -> LLM:
    kw.setdefault("num_blocks", 96)
    return LLM(path, dtype="float32", device="cpu", **kw)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.requests


class LogitsRecorder:
    """Observes the logits the engine samples from (wraps the runner's sample method)."""

    def __init__(self, llm: LLM):
        self.rows: list[torch.Tensor] = []
        runner = llm.engine.runner
        original = runner.sample

        def sample(logits, rows):
            self.rows.append(logits.clone())
            return original(logits, rows)

        runner.sample = sample


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_and_decode_logits_match(hf_models, family):
    model, path = hf_models[family]
    llm = make_llm(path)
    rec = LogitsRecorder(llm)
    prompt = prompts(1, seed=1, lo=37, hi=38)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=17, **GREEDY))[0]
    ref_tokens, ref_logits = hf_greedy(model, prompt, 17)
    ours = torch.cat(rec.rows)  # prefill logits, then 16 decode steps
    assert ours.shape == ref_logits.shape
    scale = ref_logits.abs().max()
    torch.testing.assert_close(ours, ref_logits, rtol=1e-4, atol=1e-4 * scale)
    assert out.token_ids == ref_tokens
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_greedy_32_tokens_batched_and_chunked(hf_models, family):
    model, path = hf_models[family]
    # Odd chunk size: prompts of various lengths are prefilled in 7-token chunks, mixed with decodes.
    llm = make_llm(path, max_num_batched_tokens=7, block_size=16)
    batch = prompts(4, seed=2)
    outs = llm.generate(batch, SamplingParams(max_tokens=32, **GREEDY))
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(model, prompt, 32)[0]
    assert_all_blocks_free(llm)


def test_prefix_cache_hits_give_identical_tokens(hf_models):
    model, path = hf_models["llama"]
    llm = make_llm(path, block_size=16)
    shared = prompts(1, seed=3, lo=40, hi=41)[0]
    first = llm.generate([shared + [5, 6, 7]], SamplingParams(max_tokens=32, **GREEDY))[0]
    second_prompt = shared + [9, 10]
    second = llm.generate([second_prompt], SamplingParams(max_tokens=32, **GREEDY))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32  # two full 16-token blocks of the shared prefix
    assert second.token_ids == hf_greedy(model, second_prompt, 32)[0]
    again = llm.generate([second_prompt], SamplingParams(max_tokens=32, **GREEDY))[0]
    assert again.num_cached_tokens == 32  # a 42-token prompt; its 3rd block holds part of the output
    assert again.token_ids == second.token_ids
    assert_all_blocks_free(llm)


def test_preemption_and_recompute_give_identical_tokens(hf_models):
    model, path = hf_models["qwen2"]
    # 10 blocks of 4 tokens for 4 requests growing to ~50 tokens each: preemption is certain.
    llm = make_llm(path, num_blocks=20, block_size=4, enable_prefix_caching=False)
    batch = prompts(4, seed=4, lo=10, hi=20)
    outs = llm.generate(batch, SamplingParams(max_tokens=32, **GREEDY))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(model, prompt, 32)[0]
    assert_all_blocks_free(llm)
