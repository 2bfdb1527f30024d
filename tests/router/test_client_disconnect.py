"""A client that goes away gets its backend requests aborted (bounded waits)."""

from __future__ import annotations

import httpx
import pytest

from tests.router.conftest import MODEL, wait_until


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "[slow]"}]}),
    ("/v1/completions", {"model": MODEL, "prompt": "[slow]"}),
])
def test_disconnect_mid_stream_aborts(server, backend, path, body):
    with httpx.Client(timeout=5) as client:
        with client.stream("POST", server.url + path, json={**body, "max_tokens": 50, "stream": True, "n": 2}) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the stream is running
    wanted = {f"{rid}-0", f"{rid}-1"}
    assert wait_until(lambda: wanted <= set(backend.aborted), timeout_s=5), backend.aborted
    assert wait_until(lambda: not backend.live, timeout_s=5)


def test_disconnect_while_waiting_for_non_stream_aborts(server, backend):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "[slow]", "max_tokens": 50},
                   timeout=0.5)
    assert wait_until(lambda: len(backend.requests) == 1)
    rid = backend.requests[0][0]
    assert wait_until(lambda: rid in backend.aborted, timeout_s=5), backend.aborted
    assert wait_until(lambda: not backend.live, timeout_s=5)


def test_finished_requests_are_not_aborted(server, backend):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 3, "n": 3})
    assert r.status_code == 200
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "a", "max_tokens": 3, "stream": True}) as s:
        s.read()
    assert backend.aborted == []
