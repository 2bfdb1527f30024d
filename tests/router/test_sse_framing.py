"""Exact SSE framing, checked on the raw bytes."""

from __future__ import annotations

import json

import httpx

from tests.router.conftest import MODEL, CharTokenizer, expected_text


def raw_stream(url: str, path: str, body: dict) -> tuple[httpx.Response, bytes]:
    with httpx.stream("POST", url + path, json=body, timeout=10) as response:
        return response, response.read()


def events(raw: bytes) -> list[str]:
    assert raw.endswith(b"\n\n")
    parts = raw.decode().split("\n\n")
    assert parts[-1] == ""
    for part in parts[:-1]:
        assert part.startswith("data: ") and "\n" not in part, part
    return [part.removeprefix("data: ") for part in parts[:-1]]


def test_chat_sse_framing(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    response, raw = raw_stream(server.url, "/v1/chat/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache"
    data = events(raw)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len(chunks) == 4  # role, 2 tokens, finish
    rid = response.headers["x-request-id"]
    for chunk in chunks:
        assert set(chunk) == {"id", "object", "created", "model", "system_fingerprint", "choices"}
        assert (chunk["id"] == f"chatcmpl-{rid}" and chunk["object"] == "chat.completion.chunk"
                and chunk["model"] == MODEL)
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[1:3]] == [{"content": ch} for ch in "yz"]
    assert chunks[3]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None] * 3


def test_completion_sse_framing_with_usage(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    response, raw = raw_stream(server.url, "/v1/completions", body)
    data = events(raw)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    for chunk in chunks:
        assert set(chunk) == {"id", "object", "created", "model", "choices", "usage"}
        assert chunk["object"] == "text_completion"
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == [*expected_text(CharTokenizer().encode("abc"), 2), ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


def test_completion_sse_without_usage_has_no_usage_key(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 1, "stream": True}
    _, raw = raw_stream(server.url, "/v1/completions", body)
    data = events(raw)
    assert data[-1] == "[DONE]"
    assert all("usage" not in json.loads(d) for d in data[:-1])


def test_non_stream_has_request_id_header(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 1})
    assert r.status_code == 200
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    assert r.headers["content-type"] == "application/json"
