"""Async streaming client for OpenAI-compatible `/v1/completions` and `/v1/chat/completions`.

Each request is sent with `stream: true` and `stream_options: {include_usage: true}`; the
client records the arrival time of every SSE chunk that carries output text, the final
`usage` counts (falling back to the number of text chunks when the server sends none),
the HTTP status, and any error. Optional `x-pdserve-kv-bytes` / `x-pdserve-kv-seconds`
response headers are recorded when present. Each request asks a pdserve router for its timing
(header `x-pdserve-timing: 1`, which other servers ignore); `usage.pdserve_timing`, when it
comes, breaks the TTFT down (`pdserve.loadgen.metrics.server_breakdown`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from pdserve.loadgen.datasets import RequestSpec
from pdserve.loadgen.errors import LoadgenError, ServerError, ServerUnreachable
from pdserve.loadgen.records import RequestRecord

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
KV_BYTES_HEADER = "x-pdserve-kv-bytes"
KV_SECONDS_HEADER = "x-pdserve-kv-seconds"
TIMING_HEADER = "x-pdserve-timing"  # asks a pdserve router for usage.pdserve_timing


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    endpoint: str = "chat"
    model: str | None = None
    api_key: str | None = None
    request_timeout_s: float = 600.0
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; expected one of {', '.join(ENDPOINTS)}")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"bad server URL {self.base_url!r}; expected http://HOST:PORT")
        if not (self.request_timeout_s > 0):
            raise ValueError(f"request timeout must be > 0, got {self.request_timeout_s!r}")

    @property
    def root(self) -> str:
        """The URL without a trailing `/` or `/v1`."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def make_http_client(max_connections: int | None = None, **kwargs) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0, read=None), **kwargs)


async def list_models(http: httpx.AsyncClient, cfg: ClientConfig, timeout_s: float = 10.0) -> list[str]:
    """GET /v1/models; ServerUnreachable with a one-line message if nothing answers."""
    url = cfg.root + "/v1/models"
    try:
        resp = await http.get(url, headers=cfg.headers(), timeout=timeout_s)
    except httpx.ConnectError as e:
        raise ServerUnreachable(f"cannot reach {cfg.root}: {_connect_reason(e)}") from None
    except httpx.TimeoutException:
        raise ServerUnreachable(f"cannot reach {cfg.root}: no answer within {timeout_s:g}s") from None
    except httpx.HTTPError as e:
        raise ServerUnreachable(f"cannot reach {cfg.root}: {type(e).__name__}: {e}") from None
    if resp.status_code in (401, 403):
        raise ServerError(f"{url}: HTTP {resp.status_code}; check the API key")
    if resp.status_code != 200:
        raise ServerError(f"{url}: HTTP {resp.status_code}; is this an OpenAI-compatible server?")
    try:
        return [m["id"] for m in resp.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ServerError(f"{url}: the answer is not an OpenAI model list") from None


async def resolve_model(http: httpx.AsyncClient, cfg: ClientConfig) -> str:
    models = await list_models(http, cfg)
    if cfg.model:
        return cfg.model
    if not models:
        raise LoadgenError(f"{cfg.root}/v1/models lists no model; pass --model")
    return models[0]


def _connect_reason(error: BaseException) -> str:
    """'connection refused' when that is the root cause, else the first line of the error."""
    seen = error
    for _ in range(8):  # walk the cause chain; anyio wraps the OSError
        if isinstance(seen, ConnectionRefusedError) or "refused" in str(seen).lower():
            return "connection refused"
        if isinstance(seen, ExceptionGroup):
            seen = seen.exceptions[0]
        else:
            seen = seen.__cause__ or seen.__context__
        if seen is None:
            break
    return (str(error).splitlines() or [type(error).__name__])[0]


def _error_message(status: int, body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        message = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        message = None
    if not message:
        message = body.decode(errors="replace").strip()[:200]
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _header_float(resp: httpx.Response, name: str) -> float | None:
    value = resp.headers.get(name)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class StreamingClient:
    """Sends RequestSpecs and fills RequestRecords. Share one per run."""

    def __init__(self, cfg: ClientConfig, http: httpx.AsyncClient, model: str):
        self.cfg = cfg
        self.http = http
        self.model = model
        self.url = cfg.root + ENDPOINTS[cfg.endpoint]

    def payload(self, spec: RequestSpec) -> dict:
        body = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": spec.max_tokens,
            "temperature": self.cfg.temperature,
        }
        if self.cfg.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.cfg.extra_body)
        return body

    async def fill(self, record: RequestRecord, spec: RequestSpec, t0: float) -> None:
        """Send `spec` now and record what happens into `record` (never raises, except on
        cancellation, which leaves `record.error` set)."""
        record.prompt_tokens_est = spec.prompt_tokens_est
        record.max_tokens = spec.max_tokens
        record.group = spec.group
        headers = self.cfg.headers() | {"X-Request-Id": record.request_id, TIMING_HEADER: "1"}
        start = time.perf_counter()
        record.sent_s = start - t0
        usage = None
        finished = False
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                async with self.http.stream("POST", self.url, json=self.payload(spec), headers=headers) as resp:
                    record.status = resp.status_code
                    record.kv_bytes = _header_float(resp, KV_BYTES_HEADER)
                    record.kv_seconds = _header_float(resp, KV_SECONDS_HEADER)
                    if resp.status_code != 200:
                        record.error = _error_message(resp.status_code, await resp.aread())
                        return
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            finished = True
                            break
                        now = time.perf_counter()
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            record.error = f"bad SSE chunk: {data[:80]!r}"
                            return
                        if chunk.get("error"):
                            record.error = "stream error: " + _error_message(resp.status_code, data.encode())
                            return
                        record.server_request_id = record.server_request_id or chunk.get("id")
                        usage = chunk.get("usage") or usage
                        choices = chunk.get("choices") or []
                        if any(_chunk_text(c) for c in choices):
                            record.token_times_s.append(now - start)
                        if any(c.get("finish_reason") for c in choices):
                            finished = True
            record.e2e_s = time.perf_counter() - start
        except TimeoutError:
            record.error = f"timeout after {self.cfg.request_timeout_s:g}s"
        except httpx.HTTPError as e:
            record.error = f"{type(e).__name__}: {e}".splitlines()[0] or type(e).__name__
        except asyncio.CancelledError:
            record.error = record.error or "cancelled"
            raise
        finally:
            if record.token_times_s:
                record.ttft_s = record.token_times_s[0]
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens")
                record.completion_tokens = usage.get("completion_tokens")
                record.token_count_source = "usage"
                record.server_timing = _server_timing(usage)
            else:
                record.completion_tokens = len(record.token_times_s)
                record.token_count_source = "chunks"
        if record.error is None and not finished:
            record.error = "stream ended without [DONE] or a finish_reason"


def _server_timing(usage: dict) -> dict | None:
    """Choice 0's entry of a pdserve router's `usage.pdserve_timing`, if the server sent one."""
    entries = usage.get("pdserve_timing")
    if not isinstance(entries, list):
        return None
    for entry in entries:
        if isinstance(entry, dict) and entry.get("index", 0) == 0:
            return {k: v for k, v in entry.items() if k != "index"}
    return None
