"""Per-request timing (queue, prefill, KV, first decode step) reaches the client in
`usage.pdserve_timing` when the request asks for it (or the router has --usage-timing), and
the official openai client still reads the responses; without asking, `usage` is OpenAI's."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve.timing import RequestTiming
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.recorder import TIMING_KEYS, disaggregated_timing
from pdserve.router.cluster.directory import StaticDirectory
from pdserve.router.http.formatting import CompletionFormatter
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement.registry import make_policy
from pdserve.router.http.server import create_app
from tests.router.conftest import MODEL, CharTokenizer, ServerThread
from tests.router.fake_workers import FIRST_TOKEN_TIMING, PREFILL_KV_BYTES_PER_TOKEN, Cluster, FakeWorker
from tests.router.test_cluster_openai import LoopThread

TOK = CharTokenizer()


def _serve_cluster(**app_kwargs):
    loop = LoopThread()
    shared = Cluster()
    workers = [FakeWorker("p0", "prefill", shared), FakeWorker("d0", "decode", shared)]
    try:
        for worker in workers:
            loop.call(worker.start())
        metrics = RouterMetrics()
        backend = ClusterBackend(
            StaticDirectory([w.endpoint for w in workers]), make_policy("round-robin"), TOK, MODEL, 128,
            stats_interval_s=0.05, health_timeout_s=0.5, rpc_timeout_s=1.0, kv_deadline_s=1.0, metrics=metrics,
        )
        with ServerThread(create_app(backend, metrics=metrics, **app_kwargs)) as server:
            yield server.url
    finally:
        for worker in workers:
            loop.call(worker.stop())
        loop.stop()


@pytest.fixture
def url():
    yield from _serve_cluster()


@pytest.fixture
def timing_url():
    yield from _serve_cluster(usage_timing=True)


def test_usage_timing_flag_times_every_request(timing_url):
    client = _client(timing_url)
    done = client.completions.create(model=MODEL, prompt="hello there", max_tokens=4)
    _check(done.usage.model_extra["pdserve_timing"][0], done.usage.prompt_tokens)
    stream = client.completions.create(model=MODEL, prompt="hello again", max_tokens=3, stream=True,
                                       stream_options={"include_usage": True})
    usage = list(stream)[-1].usage
    _check(usage.model_extra["pdserve_timing"][0], usage.prompt_tokens)


def _check(entry: dict, prompt_tokens: int) -> None:
    assert set(entry) <= set(TIMING_KEYS) | {"index"}
    assert entry["index"] == 0 and entry["placement"] == "disaggregated"
    assert (entry["prefill_worker"], entry["decode_worker"], entry["attempts"]) == ("p0", "d0", 1)
    assert entry["kv"] == pytest.approx(0.002) and entry["kv_bytes"] == prompt_tokens * PREFILL_KV_BYTES_PER_TOKEN
    assert entry["kv_gbps"] == pytest.approx(entry["kv_bytes"] * 8 / 0.002 / 1e9)
    assert entry["queue"] == 0.0 and entry["prefill"] == pytest.approx(0.001)
    assert entry["kv_link"] == pytest.approx(0.001) and entry["kv_link_bytes"] == entry["kv_bytes"] // 2
    for key in ("place", "reserve", "prefill_rpc", "first_decode"):
        assert 0 <= entry[key] < 2.0, key


STANDARD_USAGE = {"prompt_tokens", "completion_tokens", "total_tokens"}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)


def test_usage_has_only_openais_fields_unless_asked(url):
    """Clients that validate `usage` see OpenAI's keys only, streamed and not, on both endpoints."""
    client = _client(url)
    done = client.completions.create(model=MODEL, prompt="hello there", max_tokens=4)
    assert set(done.usage.model_dump(exclude_none=True)) == STANDARD_USAGE and not done.usage.model_extra
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert set(chat.usage.model_dump(exclude_none=True)) == STANDARD_USAGE and not chat.usage.model_extra
    stream = client.completions.create(model=MODEL, prompt="hello again", max_tokens=3, stream=True,
                                       stream_options={"include_usage": True})
    usage = list(stream)[-1].usage
    assert usage is not None and usage.completion_tokens == 3
    assert set(usage.model_dump(exclude_none=True)) == STANDARD_USAGE and not usage.model_extra
    raw = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hey", "max_tokens": 2}, timeout=10)
    assert set(raw.json()["usage"]) == STANDARD_USAGE


@pytest.mark.parametrize("ask", [{"extra_body": {"pdserve_timing": True}},
                                 {"extra_headers": {"x-pdserve-timing": "1"}}], ids=["body", "header"])
def test_timing_in_usage_streamed_and_not_when_asked(url, ask):
    client = _client(url)
    done = client.completions.create(model=MODEL, prompt="hello there", max_tokens=4, **ask)
    assert done.usage.completion_tokens == 4
    _check(done.usage.model_extra["pdserve_timing"][0], done.usage.prompt_tokens)

    stream = client.completions.create(model=MODEL, prompt="hello again", max_tokens=3, stream=True,
                                       stream_options={"include_usage": True}, **ask)
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 3
    _check(usage.model_extra["pdserve_timing"][0], usage.prompt_tokens)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          **ask)
    _check(chat.usage.model_extra["pdserve_timing"][0], chat.usage.prompt_tokens)


def test_asking_with_false_or_0_gets_no_timing(url):
    for kwargs in ({"extra_body": {"pdserve_timing": False}}, {"extra_headers": {"x-pdserve-timing": "0"}}):
        done = _client(url).completions.create(model=MODEL, prompt="hello there", max_tokens=2, **kwargs)
        assert not done.usage.model_extra, kwargs
    bad = httpx.post(url + "/v1/completions", timeout=10,
                     json={"model": MODEL, "prompt": "hey", "max_tokens": 2, "pdserve_timing": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "pdserve_timing"


def test_usage_without_timing_has_no_extension():
    class P:  # the part of router.http.preparation.Prepared that usage() reads
        num_prompt_tokens = 5
        echo = {}
        jobs = []

    formatter = CompletionFormatter(P(), MODEL, str)  # type: ignore[arg-type]
    assert formatter.usage(3, {0: None}).model_dump() == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert formatter.usage(3).model_dump() == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_timing_from_a_worker_without_link_figures():
    """A worker that reports no "link" phase (older, or the fake transport): kv_link and
    kv_link_bytes are None (not recorded), not zero."""
    from pdserve.router.cluster.worker_client import PrefillResult

    class Decision:
        prefill, decode = "p0", "d0"

    result = PrefillResult(None, 1000, 0.5, 0.0, 0.1, {"wire": 0.4})  # type: ignore[arg-type]
    timing = RequestTiming(**disaggregated_timing(Decision(), 0.01, 0.6, result))  # type: ignore[arg-type]
    assert timing.kv_link_s is None and timing.kv_link_bytes is None
    assert "kv_link" not in timing.to_json() and timing.to_json()["kv_wire"] == 0.4
    paced = PrefillResult(None, 1000, 0.5, 0.0, 0.1, {"link": 0.3}, 800)  # type: ignore[arg-type]
    timing = RequestTiming(**disaggregated_timing(Decision(), 0.01, 0.6, paced))  # type: ignore[arg-type]
    assert (timing.kv_link_s, timing.kv_link_bytes) == (0.3, 800)
    assert (timing.to_json()["kv_link"], timing.to_json()["kv_link_bytes"]) == (0.3, 800)


@pytest.fixture
def mixed_url():
    loop = LoopThread()
    worker = FakeWorker("m0", "mixed", Cluster())
    try:
        loop.call(worker.start())
        backend = ClusterBackend(StaticDirectory([worker.endpoint]), make_policy("round-robin"), TOK, MODEL, 128,
                                 stats_interval_s=0.05, health_timeout_s=0.5, rpc_timeout_s=1.0, kv_deadline_s=1.0)
        with ServerThread(create_app(backend)) as server:
            yield server.url
    finally:
        loop.call(worker.stop())
        loop.stop()


def test_local_timing_has_the_workers_part_and_the_first_token(mixed_url):
    """A request run whole on one worker: the worker's queue / prefill / hand-off of its first
    token (from the first chunk of its Generate stream), and the router's time to the first
    token and to the first text."""
    client = openai.OpenAI(base_url=mixed_url + "/v1", api_key="unused", max_retries=0, timeout=10)
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True,
                                       stream_options={"include_usage": True}, extra_headers={"x-pdserve-timing": "1"})
    entry = list(stream)[-1].usage.model_extra["pdserve_timing"][0]
    assert set(entry) <= set(TIMING_KEYS) | {"index"}
    assert (entry["placement"], entry["decode_worker"], entry["attempts"]) == ("local", "m0", 1)
    queue, prefill, handoff = FIRST_TOKEN_TIMING
    assert (entry["queue"], entry["prefill"], entry["worker_handoff"]) == (queue, prefill, handoff)
    assert 0 <= entry["place"] <= entry["first_token"] <= entry["first_text"] < 2.0
    assert "kv" not in entry and "reserve" not in entry


def test_timing_json_keys_are_the_documented_ones():
    """The 25 keys loadgen reads from `usage.pdserve_timing` (loadgen.metrics.BREAKDOWN_KEYS among them)."""
    from pdserve.loadgen.metrics import BREAKDOWN_KEYS

    assert TIMING_KEYS == RequestTiming.json_keys() and len(set(TIMING_KEYS)) == 25
    assert set(BREAKDOWN_KEYS) | {"kv_gbps", "placement"} <= set(TIMING_KEYS)
    timing = RequestTiming(placement="local", decode_worker="m0", attempts=1, place_s=0.1, kv_done_at_unix_s=5.0)
    assert timing.to_json() == {"placement": "local", "decode_worker": "m0", "attempts": 1, "place": 0.1,
                                "kv_done_at": 5.0}
