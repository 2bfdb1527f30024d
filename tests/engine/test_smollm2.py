"""The embedded default model (SmolLM2-135M-Instruct GGUF) against transformers on the same file."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.llm import LLM
from pdserve.loaders import default_model_path
from pdserve.sampling_params import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", dtype="float32", device="cpu", kv_cache_gib=0.05)


def test_greedy_tokens_equal_transformers_on_the_gguf(llm):
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    ours = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=2, attention_mask=torch.ones(1, len(prompt)))
    assert ours.token_ids == out[0, len(prompt):].tolist()
    assert "Paris" in llm.tokenizer.decode(ours.token_ids)


def test_chat_answers_paris_and_frees_blocks(llm):
    out = llm.chat(QUESTION, SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_cli_generate_answers_paris():
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.launcher.cli", "generate", "--prompt", "What is the capital of France?",
         "--max-tokens", "24", "--device", "cpu"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_stop_string_seed_and_logprobs(llm):
    prompt = "The quick brown fox"
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    a = llm.generate([prompt, "Hello"], seeded)[0]
    b = llm.generate([prompt], seeded)[0]  # alone in the batch this time
    assert a.token_ids == b.token_ids
    greedy = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    stop_word = greedy.text.split()[2]
    cut = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, stop=(stop_word,)))[0]
    assert cut.finish_reason == "stop"
    assert stop_word not in cut.text
    assert greedy.text.startswith(cut.text)
    lp = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    assert len(lp.logprobs) == 4
    for entry, token in zip(lp.logprobs, lp.token_ids):
        assert entry.token_id == token
        assert len(entry.top) == 3
        assert entry.top[0][0] == token  # greedy: the sampled token is the most likely
        assert entry.logprob == pytest.approx(entry.top[0][1])
        assert entry.logprob <= 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_penalties_change_repetition(llm):
    prompt = "Repeat after me: the the the the the the"
    plain = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    penal = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, frequency_penalty=2.0,
                                                  presence_penalty=2.0))[0]
    assert penal.token_ids != plain.token_ids
    assert len(set(penal.token_ids)) >= len(set(plain.token_ids))
