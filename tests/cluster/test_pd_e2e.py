"""The PD cluster end to end over HTTP, with standalone worker processes and real UCX:
token-identical output, the official openai client, and the failure paths."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from tests.cluster.conftest import MODEL, free_port, kill_group, pdserve, stop, wait_healthy
from tests.cluster.test_standalone import wait_address

pytestmark = pytest.mark.timeout(600)

ENGINE = ("--model", MODEL, "--kv-cache-gib", "0.03", "--device", "cpu", "--max-num-batched-tokens", "64")


class Cluster:
    def __init__(self, tmp_path) -> None:
        self.tmp = tmp_path
        self.procs: dict[str, object] = {}
        self.addresses: dict[str, str] = {}

    def worker(self, name: str, role: str) -> None:
        log = str(self.tmp / f"{name}.log")
        proc = pdserve("worker", "--role", role, *ENGINE, "--worker-id", name, log_path=log)
        self.procs[name] = proc
        self.addresses[name] = wait_address(proc, log, 120)

    def router(self, name: str, workers: list[str], *extra: str) -> str:
        port = free_port()
        log = str(self.tmp / f"{name}.log")
        entries = []
        for w in workers:
            role = {"p": "prefill", "d": "decode", "m": "mixed"}[w[0]]
            entries += ["--worker", f"{role}#{w}@{w}={self.addresses[w]}"]
        mode = ("--mode", "colocated") if workers[0].startswith("m") else ()
        proc = pdserve("router", "--model", MODEL, "--port", str(port), *mode, *entries, *extra, log_path=log)
        self.procs[name] = proc
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            state = wait_healthy(base, proc, 120, log)["backend"]["workers"]
            if len(state) == len(workers) and all(w["healthy"] for w in state.values()):
                return base
            assert time.monotonic() < deadline, state
            time.sleep(0.3)

    def stats(self, name: str) -> pb.StatsResponse:
        with grpc.insecure_channel(self.addresses[name]) as channel:
            return pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                stop(proc, signal.SIGTERM, timeout_s=20)
            if proc.poll() is None:
                kill_group(proc)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("pd"))
    try:
        for name, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"), ("m0", "mixed")):
            c.worker(name, role)  # one after another: on two cores, side by side was slower (53 s vs 37 s)
        c.pd = c.router("router-pd", ["p0", "d0", "d1"])
        c.colocated = c.router("router-colo", ["m0"])
        yield c
    finally:
        c.close()


def complete(base: str, prompt: str, max_tokens: int = 12, **extra) -> dict:
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def twenty_prompts() -> list[str]:
    rng = random.Random(3)
    words = "the a network cache prefill decode token model block layer river cloud paper stone light".split()
    shared = " ".join(rng.choice(words) for _ in range(40))
    out = []
    for i in range(20):
        if i % 4 == 0:
            out.append(shared + " " + " ".join(rng.choice(words) for _ in range(rng.randrange(1, 6))))
        elif i % 4 == 1:  # longer than a 64-token prefill chunk
            out.append(" ".join(rng.choice(words) for _ in range(rng.randrange(90, 140))))
        else:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randrange(2, 25))))
    return out


def test_token_identical_to_single_engine_and_colocated(cluster):
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams

    prompts = twenty_prompts()[:12]  # three of each kind (the worker-level UCX test takes twenty)
    engine = LLM(MODEL, device="cpu", dtype="float32", kv_cache_gib=0.05, max_num_batched_tokens=64)
    expected = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    # one request at a time through each router (each worker sees the batches it saw before), the two
    # routers at once: their workers are disjoint processes
    with ThreadPoolExecutor(1) as to_pd, ThreadPoolExecutor(1) as to_colo:
        pds = to_pd.map(lambda p: complete(cluster.pd, p, logprobs=0), prompts)
        colos = to_colo.map(lambda p: complete(cluster.colocated, p, logprobs=0), prompts)
        served = list(zip(pds, colos))
    for prompt, ref, (pd, colo) in zip(prompts, expected, served):
        want = [engine.tokenizer.token_to_str(t) for t in ref.token_ids]
        assert pd["choices"][0]["logprobs"]["tokens"] == want
        assert colo["choices"][0]["logprobs"]["tokens"] == want
        assert pd["choices"][0]["text"] == colo["choices"][0]["text"] == ref.text
        assert pd["usage"]["completion_tokens"] == len(ref.token_ids)
    moved = sum(cluster.stats(d).kv_transfer_bytes for d in ("d0", "d1"))
    assert moved > 0 and moved == cluster.stats("p0").kv_transfer_bytes  # KV went P -> D over UCX
    for name in ("p0", "d0", "d1", "m0"):
        s = cluster.stats(name)
        assert s.num_free_blocks == s.num_blocks, name


def test_openai_client_chat_and_completions(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{cluster.pd}/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens > 5
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 8
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0,
        stream=True) if c.choices)
    assert text == chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="The river", max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="The river", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6 == comp.usage.completion_tokens
    assert comp.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


def test_client_disconnect_aborts_on_both_workers(cluster):
    with httpx.stream("POST", f"{cluster.pd}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "a long story", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # leave mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = [cluster.stats(n) for n in ("p0", "d0", "d1")]
        if all(s.num_free_blocks == s.num_blocks and s.num_running == 0 for s in stats):
            break
        time.sleep(0.2)
    for s in stats:
        assert s.num_free_blocks == s.num_blocks and s.num_running == 0, s.worker_id
    metrics = httpx.get(f"{cluster.pd}/metrics", timeout=10).text
    assert 'status="aborted"' in metrics


def test_deadline_missed_falls_back_and_completes(cluster):
    base = cluster.router("router-deadline", ["p0", "d0"], "--kv-deadline-s", "0.001")
    out = complete(base, "the deadline is tight", max_tokens=6)
    assert out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["text"] == complete(cluster.colocated, "the deadline is tight", max_tokens=6)[
        "choices"][0]["text"]
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert 'pdserve:request_recoveries_total{kind="local_fallback"}' in metrics


def test_kill_decode_worker_mid_stream_migrates(cluster):
    """kill -9 the decode worker serving a stream: the client still gets the whole answer."""
    reference = complete(cluster.colocated, "migrate me please", max_tokens=60, ignore_eos=True)["choices"][0]["text"]
    received: list[str] = []
    done = threading.Event()
    status: list[int] = []

    def consume() -> None:
        with httpx.stream("POST", f"{cluster.pd}/v1/completions", timeout=180, json={
                "model": MODEL, "prompt": "migrate me please", "max_tokens": 60, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            status.append(r.status_code)
            for line in r.iter_lines():
                received.append(line)
        done.set()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    victim = None
    while victim is None and time.monotonic() < deadline:
        for name in ("d0", "d1"):
            if cluster.stats(name).num_running > 0:
                victim = name
                break
        time.sleep(0.05)
    assert victim is not None, "no decode worker picked up the stream"
    os.kill(cluster.procs[victim].pid, signal.SIGKILL)
    assert done.wait(180), "the stream hung after the decode worker died"
    import json

    events = [json.loads(line[6:]) for line in received if line.startswith("data: {")]
    assert status == [200]
    assert not any("error" in e for e in events), events[-1]
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert text == reference
    assert received[-1] == "data: [DONE]" or "data: [DONE]" in received
    metrics = httpx.get(f"{cluster.pd}/metrics", timeout=10).text
    assert 'kind="migrate"' in metrics


def test_kill_prefill_worker_requests_complete_locally(cluster):
    """kill -9 the only prefill worker with requests queued: they are re-placed (prefill on a
    decode worker) and complete."""
    results: list[dict] = []

    def send(i: int) -> None:
        results.append(complete(cluster.pd, f"queued request number {i}", max_tokens=5))

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    os.kill(cluster.procs["p0"].pid, signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert len(results) == 4
    assert all(r["usage"]["completion_tokens"] == 5 for r in results)
    after = complete(cluster.pd, "after the prefill worker died", max_tokens=4)
    assert after["usage"]["completion_tokens"] == 4
