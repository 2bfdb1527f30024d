"""`pdserve up` serving Qwen3 and the mixture-of-experts families (tiny transformers models, fp32, CPU):
disaggregated (1 prefill + 1 decode worker, the KV over UCX) and colocated (one mixed worker), the
greedy tokens of token-id prompts equal to transformers' own generate, every KV block free after.

One cluster start per (family, mode): two in the default suite, the rest in `make test-all`."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from tests.cluster.conftest import free_port, kill_group, pdserve, stop, wait_healthy
from tests.engine.conftest import build_hf_model
from tests.engine.test_model_families import hf_generate
from tests.engine.test_model_vs_transformers import prompts

pytestmark = pytest.mark.timeout(400)

MAX_TOKENS = 8


def save_word_tokenizer(directory, vocab_size: int) -> None:
    """A word-level tokenizer of exactly `vocab_size` tokens "w<id>" (every id the model can
    sample has a distinct text; bos w0 and eos w1 as the tiny models' configs say)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w2"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w0", eos_token="w1",
                            unk_token="w2").save_pretrained(directory)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """family -> (transformers model, directory with a tokenizer)."""
    cache = {}

    def get(family):
        if family not in cache:
            model = build_hf_model(family)
            path = tmp_path_factory.mktemp(f"up-{family}")
            model.save_pretrained(path)
            save_word_tokenizer(str(path), model.config.vocab_size)
            cache[family] = (model, str(path))
        return cache[family]
    return get


def _metric(base: str, name: str) -> list[float]:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return [float(v) for v in re.findall(rf"^pdserve:{name}(?:_total)?\{{[^}}]*\}} (\S+)$", text, re.M)]


def _eventually(check, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("family, mode", [
    ("qwen3_moe", "disaggregated"), ("olmoe", "colocated"),
    pytest.param("qwen3", "disaggregated", marks=SLOW), pytest.param("mixtral", "disaggregated", marks=SLOW),
    pytest.param("olmoe", "disaggregated", marks=SLOW), pytest.param("qwen3", "colocated", marks=SLOW),
    pytest.param("mixtral", "colocated", marks=SLOW), pytest.param("qwen3_moe", "colocated", marks=SLOW),
])
def test_up_serves_transformers_greedy_tokens(tmp_path, served, family, mode):
    model, path = served(family)
    batch = prompts(3, seed=11)
    expected = [[f"w{t}" for t in hf_generate(model, p, MAX_TOKENS)] for p in batch]
    port = free_port()
    log = str(tmp_path / "up.log")
    pools = ("--mode", "colocated", "--replicas", "1") if mode == "colocated" else ()
    proc = pdserve("up", "--model", path, "--device", "cpu", "--dtype", "float32", "--port", str(port),
                   "--kv-cache-gib", "0.02", "--max-num-batched-tokens", "32", "--no-warmup",
                   "--startup-timeout-s", "200", *pools, log_path=log)
    base = f"http://127.0.0.1:{port}"
    try:
        health = wait_healthy(base, proc, 300, log)
        roles = sorted(w["role"] for w in health["backend"]["workers"].values())
        assert roles == (["decode", "prefill"] if mode == "disaggregated" else ["mixed"])
        for prompt, want in zip(batch, expected):
            r = httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": path, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["logprobs"]["tokens"] == want
            assert body["usage"]["prompt_tokens"] == len(prompt)
        if mode == "disaggregated":  # the KV went prefill -> decode (counted by both)
            moved = _eventually(lambda: (m := _metric(base, "worker_kv_transfer_bytes")) and len(m) == 2
                                and min(m) > 0 and m)
            assert moved, _metric(base, "worker_kv_transfer_bytes")
        workers = 2 if mode == "disaggregated" else 1
        usage = _eventually(lambda: (u := _metric(base, "kv_cache_usage_ratio")) and len(u) == workers
                            and all(x == 0.0 for x in u) and u)
        assert usage, _metric(base, "kv_cache_usage_ratio")
        assert stop(proc, signal.SIGTERM, timeout_s=60) == 0
    finally:
        if proc.poll() is None:
            kill_group(proc)
