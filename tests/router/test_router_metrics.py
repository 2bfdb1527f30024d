"""Prometheus metrics: per-app registries and what a request records."""

from __future__ import annotations

import httpx
from prometheus_client import REGISTRY

from pdserve.router.metrics import RouterMetrics
from pdserve.router.http.server import create_app, get_metrics, metrics_registry
from tests.router.conftest import MODEL, FakeBackend


def sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_requests_and_tokens_are_counted(serve, backend):
    server = serve()
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 5, "n": 2})
    assert ok.status_code == 200
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
    }) as r:
        r.read()
    assert httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL}).status_code == 400
    text = httpx.get(server.url + "/metrics").text
    assert sample(text, 'pdserve:requests_total{endpoint="completions",status="ok"}') == 1
    assert sample(text, 'pdserve:requests_total{endpoint="chat",status="ok"}') == 1
    assert sample(text, 'pdserve:requests_total{endpoint="chat",status="error"}') == 1
    chat_prompt = len("<user>hi\n<assistant>")
    assert sample(text, "pdserve:prompt_tokens_total") == 4 + chat_prompt
    assert sample(text, "pdserve:generation_tokens_total") == 10 + 3
    assert sample(text, "pdserve:time_to_first_token_seconds_count") == 3
    assert sample(text, "pdserve:time_per_output_token_seconds_count") == 3
    assert sample(text, "pdserve:e2e_request_latency_seconds_count") == 3
    assert "# TYPE pdserve:placement_decisions_total counter" in text


def test_prefix_cache_tokens_are_counted_per_prefilled_request(serve, backend):
    """pdserve:prefix_cache_{hit,query}_tokens_total: each choice's prompt tokens, and the cached
    tokens its worker reported; a request refused before prefill counts nothing."""
    server = serve()
    for prompt, n in (("[cached]abc", 2), ("xyz", 1)):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "n": n})
        assert r.status_code == 200
    assert httpx.post(server.url + "/v1/completions", json={"model": MODEL, "max_tokens": 2}).status_code == 400
    text = httpx.get(server.url + "/metrics").text
    prompt_lens = [len(ids) for _, ids, _ in backend.requests]
    assert prompt_lens == [len("[cached]abc") + 1] * 2 + [len("xyz") + 1]  # + BOS
    assert sample(text, "pdserve:prefix_cache_query_tokens_total") == sum(prompt_lens)
    assert sample(text, "pdserve:prefix_cache_hit_tokens_total") == 2 * 5


def test_aborted_requests_are_counted(serve, backend):
    server = serve()
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "[slow]", "max_tokens": 50, "stream": True}) as r:
        next(r.iter_lines())
    from tests.router.conftest import wait_until

    def aborted() -> bool:
        text = httpx.get(server.url + "/metrics").text
        return 'pdserve:requests_total{endpoint="completions",status="aborted"} 1.0' in text

    assert wait_until(aborted)


def test_each_app_has_its_own_registry():
    a, b = create_app(FakeBackend()), create_app(FakeBackend())
    assert metrics_registry(a) is not metrics_registry(b)
    assert metrics_registry(a) is not REGISTRY
    get_metrics(a).placement_decisions.labels(policy="round_robin", kind="disaggregated").inc()
    text = get_metrics(a).render().decode()
    assert 'pdserve:placement_decisions_total{kind="disaggregated",policy="round_robin"} 1.0' in text
    assert "round_robin" not in get_metrics(b).render().decode()


def test_metrics_can_be_passed_in():
    metrics = RouterMetrics()
    assert get_metrics(create_app(FakeBackend(), metrics=metrics)) is metrics
