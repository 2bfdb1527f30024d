"""The published API description (/openapi.json) against the server's real answers.

Requests are generated from the published request schemas (tests/router/schema_instances.py)
and sent to a router over fake gRPC workers (1 prefill + 1 decode); every answer must have a
status the document lists for the operation and a body (JSON, or each SSE event) that its
schema accepts.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.directory import StaticDirectory
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement.registry import make_policy
from pdserve.router.http.server import create_app
from tests.router.conftest import MODEL, CharTokenizer, ServerThread
from tests.router.fake_workers import Cluster, FakeWorker
from tests.router.schema_instances import SchemaInstances
from tests.router.test_cluster_openai import LoopThread

API_KEY = "sk-test"
REQUESTS_PER_ENDPOINT = 160  # the request schemas have many optional fields that are often invalid at random


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    loop = LoopThread()
    shared = Cluster()
    workers = [FakeWorker("p0", "prefill", shared), FakeWorker("d0", "decode", shared)]
    try:
        for worker in workers:
            loop.call(worker.start())
        metrics = RouterMetrics()
        backend = ClusterBackend(
            StaticDirectory([w.endpoint for w in workers]), make_policy("round-robin"), CharTokenizer(), MODEL, 128,
            stats_interval_s=0.05, health_timeout_s=0.5, rpc_timeout_s=2.0, kv_deadline_s=2.0, metrics=metrics,
        )
        app = create_app(backend, api_key=API_KEY, metrics=metrics, max_body_bytes=4096)
        with ServerThread(app) as server:
            yield server.url
    finally:
        for worker in workers:
            loop.call(worker.stop())
        loop.stop()


@pytest.fixture(scope="module")
def doc(router_url: str) -> dict[str, Any]:
    r = httpx.get(router_url + "/openapi.json", timeout=10)
    assert r.status_code == 200
    return r.json()


def validator(doc: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def check_answer(doc: dict[str, Any], op: dict[str, Any], r: httpx.Response, stream: bool) -> None:
    documented = op["responses"]
    assert str(r.status_code) in documented, (r.status_code, r.text)
    content = documented[str(r.status_code)]["content"]
    media = r.headers["content-type"].split(";")[0]
    assert media in content, (media, list(content))
    if media == "text/event-stream":
        assert stream
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        data = validator(doc, content[media]["x-sse-data"])
        for event in events[:-1]:
            data.validate(json.loads(event))
        if events[-1] != "[DONE]":  # an error event ends the stream instead
            data.validate(json.loads(events[-1]))
        return
    validator(doc, content[media]["schema"]).validate(r.json())
    if r.status_code == 200:
        assert not stream, "a stream request was answered with one JSON body"


def test_generation_endpoints_publish_request_response_and_errors(doc):
    schemas = doc["components"]["schemas"]
    for path, request in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{request}"}
        validator(doc, body["schema"]).validate(body["example"])
        assert {"400", "401", "404", "413", "429", "503"} <= set(op["responses"])
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "422" not in op["responses"]
    props = schemas["CompletionRequest"]["properties"]
    assert props["n"]["default"] == 1 and (props["n"]["minimum"], props["n"]["maximum"]) == (1, 16)
    assert (props["top_p"]["exclusiveMinimum"], props["top_p"]["maximum"]) == (0, 1)
    assert props["logprobs"]["maximum"] == 20 and props["model"]["examples"] == [MODEL]
    assert set(schemas["CompletionRequest"]["required"]) == {"model", "prompt"}
    assert set(schemas["ChatCompletionRequest"]["required"]) == {"model", "messages"}
    assert set(schemas["ErrorBody"]["required"]) == {"message", "type", "param", "code"}
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]


def test_metrics_is_described_and_served_as_text(doc, router_url):
    content = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]
    r = httpx.get(router_url + "/metrics", timeout=5)
    assert r.headers["content-type"].startswith("text/plain")
    assert "pdserve:requests_total" in r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_requests_generated_from_the_schema_get_documented_answers(doc, router_url, path):
    op = doc["paths"][path]["post"]
    request_schema = op["requestBody"]["content"]["application/json"]["schema"]
    check_request = validator(doc, request_schema)
    gen = SchemaInstances(doc, random.Random(1))
    statuses: dict[tuple[int, bool], int] = {}
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=router_url, headers=headers, timeout=20) as client:
        for _ in range(REQUESTS_PER_ENDPOINT):
            body = gen.generate(request_schema)
            check_request.validate(body)  # the generator stays inside the schema
            r = client.post(path, json=body)
            stream = body.get("stream", False)
            check_answer(doc, op, r, stream)
            assert r.status_code < 500, (body, r.text)  # healthy workers: a request alone never earns a 5xx
            statuses[(r.status_code, stream)] = statuses.get((r.status_code, stream), 0) + 1
        # the errors the generator cannot reach: no key, a body over the limit
        r = httpx.post(router_url + path, json=body, timeout=5)
        check_answer(doc, op, r, False)
        assert r.status_code == 401
        r = client.post(path, content=b"{" + b" " * 5000 + b"}", headers={"content-type": "application/json"})
        check_answer(doc, op, r, False)
        assert r.status_code == 413
    # the schema leads to real generations of both kinds, and to 400s for what it cannot express
    assert statuses.get((200, False), 0) >= 5 and statuses.get((200, True), 0) >= 5, statuses
    assert statuses.get((400, False), 0) + statuses.get((400, True), 0) >= 5, statuses


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "abc", **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


AGREEMENT_CASES = [
    # (path, body, the param a refusal names); the schema and the server must agree on each
    ("/v1/completions", _completion(max_tokens=4.0), "max_tokens"),
    ("/v1/completions", _completion(max_tokens=4.5), "max_tokens"),
    ("/v1/completions", _completion(n=2.0, seed=3.0, logprobs=1.0, top_k=5.0, min_tokens=1.0), None),
    ("/v1/completions", _completion(prompt=[5.0, 6], stop_token_ids=[7.0]), None),
    ("/v1/completions", _completion(best_of=15, n=1), "best_of"),
    ("/v1/completions", _completion(best_of=2), "best_of"),
    ("/v1/completions", _completion(best_of=15, n=15, max_tokens=1), "best_of"),
    ("/v1/completions", _completion(best_of=1), "best_of"),
    ("/v1/completions", _completion(best_of=None, n=3), "best_of"),
    ("/v1/completions", _completion(best_of=3.0, n=3), "best_of"),
    ("/v1/chat/completions", _chat(max_completion_tokens=3.0), "max_completion_tokens"),
    ("/v1/chat/completions", _chat(max_tokens=3.0, logprobs=True, top_logprobs=2.0), None),
    ("/v1/chat/completions", _chat(max_tokens=0.5), "max_tokens"),
    ("/v1/chat/completions", _chat(seed=1.25), "seed"),
]


@pytest.mark.parametrize("path, body, param", AGREEMENT_CASES)
def test_schema_and_server_agree(doc, router_url, path, body, param):
    """A body the published schema accepts is served (200); one it refuses gets a 400 naming the field."""
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    valid = validator(doc, schema).is_valid(body)
    r = httpx.post(router_url + path, json=body, headers={"authorization": f"Bearer {API_KEY}"}, timeout=20)
    assert r.status_code == (200 if valid else 400), (valid, r.text)
    if not valid:
        assert r.json()["error"]["param"] == param


def test_schema_accepts_integral_floats_and_best_of_only_equal_to_n(doc):
    schema = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    check = validator(doc, schema)
    assert check.is_valid(_completion(max_tokens=24116.0)) and not check.is_valid(_completion(max_tokens=24116.5))
    assert not check.is_valid(_completion(best_of=15, n=1)) and check.is_valid(_completion(best_of=15, n=15))
    assert "equal to n" in doc["components"]["schemas"]["CompletionRequest"]["properties"]["best_of"]["description"]


def test_a_float_max_tokens_reaches_the_context_check(router_url):
    """24116.0 is taken as the integer 24116: refused for the context length, not for its type."""
    r = httpx.post(router_url + "/v1/completions", json=_completion(max_tokens=24116.0),
                   headers={"authorization": f"Bearer {API_KEY}"}, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_max_tokens_defaults_are_documented(doc):
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "minutes" in chat["max_completion_tokens"]["description"]
    assert "--max-tokens-default" in chat["max_completion_tokens"]["description"]
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "--max-tokens-default" in completion["max_tokens"]["description"]


def test_docs_load_only_local_assets(router_url):
    """/docs works offline: its page names no other host, and every asset it names is served."""
    r = httpx.get(router_url + "/docs", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "//" not in r.text.replace("window.location.origin", ""), "an absolute URL in /docs"
    assets = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert any(a.endswith(".js") for a in assets) and any(a.endswith(".css") for a in assets), assets
    for asset in assets + re.findall(r"url: '([^']+)'", r.text):
        assert asset.startswith("/"), asset
        got = httpx.get(router_url + asset, timeout=10)
        assert got.status_code == 200 and got.content, asset
    assert "SwaggerUIBundle" in httpx.get(router_url + next(a for a in assets if a.endswith(".js")), timeout=10).text


def test_responses_is_described_and_answers_as_described(doc, router_url):
    op = doc["paths"]["/v1/responses"]["post"]
    body = op["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/ResponsesRequest"}
    validator(doc, body["schema"]).validate(body["example"])
    assert {"400", "401", "404", "413", "429", "503"} <= set(op["responses"])
    content = op["responses"]["200"]["content"]
    assert "response.completed" in content["text/event-stream"]["schema"]["description"]
    headers = {"authorization": f"Bearer {API_KEY}"}
    r = httpx.post(router_url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3},
                   headers=headers, timeout=20)
    assert r.status_code == 200, r.text
    validator(doc, content["application/json"]["schema"]).validate(r.json())
    r = httpx.post(router_url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3,
                                                       "stream": True}, headers=headers, timeout=20)
    events = [e for e in r.text.split("\n\n") if e]
    check = validator(doc, content["text/event-stream"]["x-sse-data"])
    for event in events:
        kind, data = event.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        check.validate(payload)
    assert payload["type"] == "response.incomplete"
    validator(doc, {"$ref": "#/components/schemas/ResponseObject"}).validate(payload["response"])
