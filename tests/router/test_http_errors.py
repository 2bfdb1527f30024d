"""Every bad input and backend failure gets the exact status and OpenAI error body."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.router.errors import Overloaded, RequestTimeout, ServiceUnavailable
from pdserve.router.http.server import create_app
from tests.router.conftest import MODEL, wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"]
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MSGS, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "abc", **fields}


BAD_REQUESTS = [
    # (path, body, param, code)
    (CHAT, {"model": MODEL}, "messages", "missing_required_parameter"),
    (COMPLETIONS, {"model": MODEL}, "prompt", "missing_required_parameter"),
    (CHAT, {"messages": MSGS}, "model", "missing_required_parameter"),
    (CHAT, chat(n="2"), "n", "invalid_value"),
    (CHAT, chat(stream="yes"), "stream", "invalid_value"),
    (CHAT, chat(temperature="hot"), "temperature", "invalid_value"),
    (CHAT, chat(max_tokens=2.5), "max_tokens", "invalid_value"),
    (COMPLETIONS, completion(max_tokens=2.5), "max_tokens", "invalid_value"),
    (COMPLETIONS, completion(max_tokens=True), "max_tokens", "invalid_value"),
    (CHAT, chat(max_completion_tokens=3.25), "max_completion_tokens", "invalid_value"),
    (CHAT, chat(seed=0.5), "seed", "invalid_value"),
    (CHAT, chat(n=1.5), "n", "invalid_value"),
    (COMPLETIONS, completion(stop_token_ids=[2.5]), "stop_token_ids[0]", "invalid_value"),
    (COMPLETIONS, completion(prompt=[5, 6.5]), "prompt", "invalid_value"),
    (CHAT, {"model": MODEL, "messages": "hi"}, "messages", "invalid_value"),
    (CHAT, chat(messages=[{"role": "bot", "content": "x"}]), "messages[0].role", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[1].content", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "extra": 1}]), "messages[0].extra", "unknown_parameter"),
    (CHAT, chat(messages=[]), "messages", "invalid_value"),
    (CHAT, chat(foo=1), "foo", "unknown_parameter"),
    (CHAT, chat(tools=[{"type": "retrieval"}]), "tools[0]", "invalid_value"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f g"}}]), "tools[0].function.name", "invalid_value"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "x": 1}}]), "tools[0].function.x",
     "unknown_parameter"),
    (CHAT, chat(tool_choice="required"), "tool_choice", "invalid_value"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}),
     "response_format.json_schema.schema", "unsupported_schema"),
    (CHAT, chat(response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex", "invalid_value"),
    (COMPLETIONS, completion(guided_regex="a+", guided_choice=["a"]), "guided_choice", "invalid_value"),
    (COMPLETIONS, completion(structured_outputs={"regex": "(", "json_object": True}), "structured_outputs",
     "invalid_value"),
    (COMPLETIONS, completion(structured_outputs={"regex": "("}), "structured_outputs.regex", "invalid_value"),
    (COMPLETIONS, completion(structured_outputs={"jsonn": {}}), "structured_outputs.jsonn", "unknown_parameter"),
    (CHAT, chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
    (CHAT, chat(function_call={"name": "f"}), "function_call", "unsupported_parameter"),
    (CHAT, chat(tools="none"), "tools", "invalid_value"),
    (CHAT, chat(metadata={"k": 1}), "metadata.k", "invalid_value"),
    (CHAT, chat(response_format={"type": "text", "x": 1}), "response_format", "invalid_value"),
    (COMPLETIONS, completion(response_format={"type": "text"}), "response_format", "unknown_parameter"),
    (COMPLETIONS, completion(prompt=[]), "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=["a", 1]), "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=[[]]), "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=[1, -1]), "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=5), "prompt", "invalid_value"),
    (CHAT, chat(n=0), "n", "invalid_value"),
    (CHAT, chat(n=17), "n", "invalid_value"),
    (COMPLETIONS, completion(n=17), "n", "invalid_value"),
    (CHAT, chat(top_p=0), "top_p", "invalid_value"),
    (CHAT, chat(top_p=1.5), "top_p", "invalid_value"),
    (CHAT, chat(temperature=-0.1), "temperature", "invalid_value"),
    (CHAT, chat(presence_penalty=2.5), "presence_penalty", "invalid_value"),
    (COMPLETIONS, completion(frequency_penalty=-3), "frequency_penalty", "invalid_value"),
    (CHAT, chat(top_k=-2), "top_k", "invalid_value"),
    (CHAT, chat(max_tokens=0), "max_tokens", "invalid_value"),
    (CHAT, chat(max_completion_tokens=0), "max_completion_tokens", "invalid_value"),
    (CHAT, chat(stop=[""]), "stop", "invalid_value"),
    (CHAT, chat(stop=5), "stop", "invalid_value"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
    (CHAT, chat(top_logprobs=2), "top_logprobs", "invalid_value"),
    (COMPLETIONS, completion(logprobs=21), "logprobs", "invalid_value"),
    (COMPLETIONS, completion(logprobs=1, echo=True), "echo", "unsupported_parameter"),
    (COMPLETIONS, completion(suffix="x"), "suffix", "unsupported_parameter"),
    (COMPLETIONS, completion(best_of=3), "best_of", "unsupported_parameter"),
    (CHAT, chat(logit_bias={"x5": 1.0}), "logit_bias", "invalid_value"),
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias", "invalid_value"),
    (COMPLETIONS, completion(logit_bias={"-1": 1}), "logit_bias", "invalid_value"),
    (CHAT, chat(logit_bias={"5": "up"}), "logit_bias.5", "invalid_value"),
    (CHAT, chat(bad_words=[""]), "bad_words[0]", "invalid_value"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options", None),
    (CHAT, chat(stream=True, stream_options={"include_usage": True, "x": 1}), "stream_options.x", "unknown_parameter"),
    (CHAT, chat(messages=[{"role": "assistant", "content": "x"}]), "messages", None),  # the template rejects it
]


@pytest.mark.parametrize("path, body, param, code", BAD_REQUESTS)
def test_bad_request(server, backend, path, body, param, code):
    err = error_of(httpx.post(server.url + path, json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code)
    assert backend.requests == []


def test_messages_name_the_problem(server):
    err = error_of(httpx.post(server.url + CHAT, json=chat(foo=1)), 400)
    assert err["message"] == "Unrecognized request argument supplied: foo"
    err = error_of(httpx.post(server.url + CHAT, json={"model": MODEL}), 400)
    assert err["message"] == "Missing required parameter: 'messages'."
    err = error_of(httpx.post(server.url + CHAT, json=chat(top_p=2)), 400)
    assert err["message"] == "top_p must be in (0, 1], got 2.0."


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"'])
def test_malformed_json(server, raw):
    err = error_of(httpx.post(server.url + CHAT, content=raw, headers={"content-type": "application/json"}), 400)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "invalid_json")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_unknown_model_is_404(server, path):
    body = chat(model="gpt-9") if path == CHAT else completion(model="gpt-9")
    err = error_of(httpx.post(server.url + path, json=body), 404)
    assert err == {"message": "The model `gpt-9` does not exist.", "type": "invalid_request_error", "param": "model",
                   "code": "model_not_found"}


def test_prompt_longer_than_max_model_len(server, backend):
    err = error_of(httpx.post(server.url + COMPLETIONS, json=completion(prompt="x" * 200)), 400)
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    assert "128" in err["message"] and "201" in err["message"]
    err = error_of(httpx.post(server.url + CHAT, json=chat(messages=[{"role": "user", "content": "x" * 200}])), 400)
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded")
    # a prompt that fills the context leaves no room for even one token
    err = error_of(httpx.post(server.url + COMPLETIONS, json=completion(prompt=[5] * 128, max_tokens=1)), 400)
    assert err["code"] == "context_length_exceeded"
    assert backend.requests == []


def test_prompt_plus_max_tokens_over_limit(server, backend):
    err = error_of(httpx.post(server.url + COMPLETIONS, json=completion(max_tokens=125)), 400)
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    assert "128" in err["message"] and "129" in err["message"] and "4 in the prompt" in err["message"]
    ok = httpx.post(server.url + COMPLETIONS, json=completion(max_tokens=124))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 124
    prompt_len = len("<user>hi\n<assistant>")
    err = error_of(httpx.post(server.url + CHAT, json=chat(max_completion_tokens=129 - prompt_len)), 400)
    assert err["param"] == "max_completion_tokens"


def test_default_max_tokens_is_clipped_to_the_room_left(server, backend):
    r = httpx.post(server.url + COMPLETIONS, json=completion(prompt=[5] * 120))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_integral_floats_are_integers(server, backend):
    """JSON Schema's integers include 3.0: every integer field takes them, as the int they are."""
    r = httpx.post(server.url + COMPLETIONS, json=completion(
        prompt=[5.0, 6], max_tokens=3.0, n=2.0, seed=7.0, best_of=2.0, logprobs=1.0, top_k=4.0, min_tokens=1.0,
        stop_token_ids=[3.0]))
    assert r.status_code == 200, r.text
    assert [len(c["text"]) for c in r.json()["choices"]] == [3, 3]
    (_, prompt, params), _ = backend.requests
    assert prompt == [5, 6] and type(prompt[0]) is int
    assert (params.max_tokens, params.seed, params.logprobs, params.top_k, params.min_tokens) == (3, 7, 1, 4, 1)
    assert params.stop_token_ids == (3,)
    r = httpx.post(server.url + CHAT, json=chat(max_completion_tokens=2.0, logprobs=True, top_logprobs=1.0))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 1


def test_top_logprobs_out_of_range_is_named_in_the_message(server):
    err = error_of(httpx.post(server.url + CHAT, json=chat(logprobs=True, top_logprobs=50)), 400)
    assert err["param"] == "top_logprobs"
    assert err["message"] == "top_logprobs must be an integer in [0, 20], got 50."
    err = error_of(httpx.post(server.url + COMPLETIONS, json=completion(logprobs=50)), 400)
    assert (err["param"], err["message"]) == ("logprobs", "logprobs must be an integer in [0, 20], got 50.")


def test_max_tokens_default_caps_requests_without_max_tokens(serve, backend):
    server = serve(max_tokens_default=5)
    r = httpx.post(server.url + CHAT, json=chat())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    r = httpx.post(server.url + COMPLETIONS, json=completion())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    # the room left in the context still bounds the default; an explicit max_tokens is the request's own
    r = httpx.post(server.url + COMPLETIONS, json=completion(prompt=[5] * 125))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(server.url + CHAT, json=chat(max_tokens=9))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 9
    err = error_of(httpx.post(server.url + COMPLETIONS, json=completion(max_tokens=126)), 400)
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    assert [params.max_tokens for _, _, params in backend.requests] == [5, 5, 3, 9]


def test_without_max_tokens_default_chat_runs_to_the_end_of_the_context(server, backend):
    r = httpx.post(server.url + CHAT, json=chat())
    prompt_len = r.json()["usage"]["prompt_tokens"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 128 - prompt_len


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_max_tokens_default_must_be_a_positive_integer(backend, value):
    with pytest.raises(ValueError, match="max_tokens_default"):
        create_app(backend, max_tokens_default=value)


def test_unknown_route_and_method(server):
    err = error_of(httpx.post(server.url + "/v1/nope", json={}), 404)
    assert err == {"message": "Invalid URL (POST /v1/nope)", "type": "invalid_request_error", "param": None,
                   "code": "unknown_url"}
    error_of(httpx.get(server.url + "/nope"), 404)
    r = httpx.get(server.url + CHAT)
    err = error_of(r, 405)
    assert r.headers["allow"] == "POST" and err["type"] == "invalid_request_error"
    error_of(httpx.post(server.url + "/health"), 405)


def test_body_over_limit_by_content_length(serve, backend):
    server = serve(max_body_bytes=1024)
    body = json.dumps(completion(prompt="x" * 2000)).encode()
    err = error_of(httpx.post(server.url + COMPLETIONS, content=body), 413)
    assert (err["type"], err["code"]) == ("invalid_request_error", "request_too_large")
    assert "1024" in err["message"]
    small = httpx.post(server.url + COMPLETIONS, json=completion(max_tokens=1))
    assert small.status_code == 200
    assert len(backend.requests) == 1


def test_body_over_limit_chunked(serve, backend):
    server = serve(max_body_bytes=1024)

    def chunks():
        yield b'{"model": "fake-model", "prompt": "'
        for _ in range(8):
            yield b"x" * 256
        yield b'"}'

    r = httpx.post(server.url + COMPLETIONS, content=chunks())
    assert r.request.headers.get("transfer-encoding") == "chunked"
    err = error_of(r, 413)
    assert err["code"] == "request_too_large"
    assert backend.requests == []


def test_default_body_limit_is_2_mib(server, backend):
    body = json.dumps(completion(prompt="x" * (2 * 1024 * 1024))).encode()
    error_of(httpx.post(server.url + COMPLETIONS, content=body, timeout=10), 413)


class TestApiKey:
    def test_v1_routes_need_the_key(self, serve):
        server = serve(api_key="s3cret")
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                        {"authorization": "Basic s3cret"}):
            err = error_of(httpx.post(server.url + CHAT, json=chat(max_tokens=1), headers=headers), 401)
            assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
            error_of(httpx.get(server.url + "/v1/models", headers=headers), 401)
        ok = httpx.post(server.url + CHAT, json=chat(max_tokens=1), headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(server.url + "/v1/models", headers={"authorization": "Bearer s3cret"}).status_code == 200

    def test_health_and_metrics_are_open(self, serve):
        server = serve(api_key="s3cret")
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200

    def test_openai_client_gets_authentication_error(self, serve):
        import openai

        server = serve(api_key="s3cret")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="a", max_tokens=1).usage.completion_tokens == 1


@pytest.mark.parametrize(
    "exc, status, type_, code",
    [
        (ServiceUnavailable("no decode workers"), 503, "server_error", "service_unavailable"),
        (Overloaded("queue full"), 429, "rate_limit_error", "overloaded"),
        (RequestTimeout("too slow"), 504, "timeout_error", "timeout"),
        (RuntimeError("bug in backend"), 500, "server_error", None),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_backend_error_before_first_token(server, backend, exc, status, type_, code, stream):
    backend.fail_with = exc
    err = error_of(httpx.post(server.url + CHAT, json=chat(stream=stream), timeout=5), status)
    assert (err["type"], err["code"]) == (type_, code)
    if isinstance(exc, RuntimeError):
        assert "bug in backend" not in err["message"]  # internals stay inside
    else:
        assert err["message"] == str(exc)


def test_backend_error_mid_stream_becomes_an_error_event(server, backend):
    backend.fail_mid = ServiceUnavailable("decode worker lost")
    body = completion(max_tokens=10, stream=True, n=2)
    with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=5) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert "[DONE]" not in events
    assert json.loads(events[-1]) == {"error": {"message": "decode worker lost", "type": "server_error", "param": None,
                                                "code": "service_unavailable"}}
    rid = r.headers["x-request-id"]
    assert wait_until(lambda: {f"{rid}-0", f"{rid}-1"} <= set(backend.aborted))


def test_backend_error_mid_non_stream(server, backend):
    backend.fail_mid = Overloaded("evicted")
    err = error_of(httpx.post(server.url + CHAT, json=chat(max_tokens=10), timeout=5), 429)
    assert err["message"] == "evicted"


def test_request_timeout_aborts(serve, backend):
    server = serve(request_timeout_s=0.3)
    r = httpx.post(server.url + COMPLETIONS, json=completion(prompt="[slow]", max_tokens=20), timeout=5)
    err = error_of(r, 504)
    assert err["code"] == "timeout"
    assert f"{r.headers['x-request-id']}-0" in backend.aborted


def test_health(serve, backend):
    server = serve(health_timeout_s=0.2)
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "backend": {"workers": 2}}
    backend.healthy = False
    err = error_of(httpx.get(server.url + "/health"), 503)
    assert err["code"] == "service_unavailable" and "no decode workers" in err["message"]

    async def hang() -> dict:
        await asyncio.sleep(30)
        return {}

    backend.healthy = True
    backend.health = hang
    err = error_of(httpx.get(server.url + "/health", timeout=5), 503)
    assert "0.2" in err["message"]
