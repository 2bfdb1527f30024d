"""`pdserve up` on CPU with tensor-parallel workers: P TP=1 + D TP=2, P TP=2 + D TP=1 and
P TP=2 + D TP=2 each answer token-identical to the single TP=1 engine (which the 1+1 cluster
equals, test_pd_e2e) through the official openai client, with every KV block free after; a
killed rank takes its whole worker out, the router rides through, and Ray brings it back."""

from __future__ import annotations

import re
import signal
import time

import httpx
import psutil
import pytest

from tests.cluster.conftest import descendants, free_port, kill_group, pdserve, stop, wait_healthy

pytestmark = pytest.mark.timeout(300)

MODEL = "random:tiny-serve-tp"  # 6 heads, 2 KV heads, SmolLM2's vocabulary
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
MAX_TOKENS = 5


def _tokenizer() -> str:
    from pdserve.loaders import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def expected():
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams

    engine = LLM(MODEL, tokenizer=_tokenizer(), device="cpu", dtype="float32", kv_cache_gib=0.02)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [[engine.tokenizer.token_to_str(t) for t in o.token_ids] for o in outs]


def _up(tmp_path, p_tp: int, d_tp: int):
    port = free_port()
    log = str(tmp_path / f"up-{p_tp}{d_tp}.log")
    proc = pdserve("up", "--model", MODEL, "--tokenizer", _tokenizer(), "--device", "cpu", "--dtype", "float32",
                   "--port", str(port), "--kv-cache-gib", "0.02", "--no-warmup", "--prefill-tp", str(p_tp),
                   "--decode-tp", str(d_tp), "--startup-timeout-s", "150", log_path=log)
    return proc, f"http://127.0.0.1:{port}", log


def _blocks_in_use(base: str) -> list[float]:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return [float(v) for v in re.findall(r"^pdserve:kv_cache_usage_ratio\{[^}]*\} (\S+)$", text, re.M)]


def _wait_all_free(base: str, workers: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        usage = _blocks_in_use(base)
        if len(usage) == workers and all(u == 0.0 for u in usage):
            return
        assert time.monotonic() < deadline, usage
        time.sleep(0.5)


def _answers(client) -> list[list[str]]:
    out = []
    for prompt in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True})
        out.append(r.choices[0].logprobs.tokens)
    return out


def _followers(proc) -> list[psutil.Process]:
    """The tensor-parallel ranks 1..N-1 (spawned children of a worker actor)."""
    return [p for p in descendants(proc.pid) if "WorkerActo" not in p.name() and p.parent() is not None
            and "WorkerActo" in p.parent().name() and "multiprocessing" in " ".join(p.cmdline())
            and "resource_tracker" not in " ".join(p.cmdline())]


# (2, 1) in the default suite; (1, 2) and (2, 2) in `make test-all` (a cluster start each: the
# default suite's time; tests/parallel/test_tp_kv.py moves KV between TP 1 and 2 both ways, in one process)
@pytest.mark.parametrize("p_tp, d_tp", [pytest.param(1, 2, marks=pytest.mark.slow), (2, 1),
                                        pytest.param(2, 2, marks=pytest.mark.slow)])
def test_up_pd_across_tp_degrees_with_the_openai_client(tmp_path, expected, p_tp, d_tp):
    openai = pytest.importorskip("openai")
    proc, base, log = _up(tmp_path, p_tp, d_tp)
    try:
        health = wait_healthy(base, proc, 200, log)
        assert sorted(w["role"] for w in health["backend"]["workers"].values()) == ["decode", "prefill"]
        assert len(_followers(proc)) == (p_tp - 1) + (d_tp - 1)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        assert _answers(client) == expected
        # disaggregated: the KV crossed between the TP degrees (the workers' counters reach the
        # router's /metrics with its next stats poll)
        deadline = time.monotonic() + 10
        while True:
            text = httpx.get(f"{base}/metrics", timeout=5).text
            moved = [float(v) for v in re.findall(r"^pdserve:worker_kv_transfer_bytes(?:_total)?\{[^}]*\} (\S+)$",
                                                  text, re.M)]
            if (len(moved) == 2 and min(moved) > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert len(moved) == 2 and min(moved) > 0, moved
        _wait_all_free(base, 2)

        if (p_tp, d_tp) == (1, 2):
            # kill -9 the decode worker's rank 1: its rank 0 exits too (no hang), the router rides
            # through (the prefill worker stands in), Ray restarts the worker and it serves again
            before = {k: w["address"] for k, w in health["backend"]["workers"].items()}
            rank1 = _followers(proc)
            assert len(rank1) == 1
            actor = rank1[0].parent()
            rank1[0].kill()
            psutil.wait_procs([actor], timeout=30)
            assert not actor.is_running() or actor.status() == psutil.STATUS_ZOMBIE
            r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=0, extra_body={"ignore_eos": True})
            assert r.choices[0].logprobs.tokens == expected[0]
            deadline = time.monotonic() + 120
            while True:
                h = httpx.get(f"{base}/health", timeout=5)
                workers = h.json()["backend"]["workers"] if h.status_code == 200 else {}
                after = {k: w["address"] for k, w in workers.items()}
                if (after.keys() == before.keys() and all(w["healthy"] for w in workers.values())
                        and after["pdserve:default:decode:0"] != before["pdserve:default:decode:0"]):
                    break
                assert time.monotonic() < deadline, h.text
                time.sleep(0.5)
            assert len(_followers(proc)) == 1  # the restarted worker spawned its rank 1 again
            assert _answers(client) == expected
            _wait_all_free(base, 2)
        assert stop(proc, signal.SIGTERM, timeout_s=60) == 0
    finally:
        if proc.poll() is None:
            kill_group(proc)
