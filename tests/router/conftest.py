"""A char-level tokenizer, a deterministic fake backend, and the app served by uvicorn in a thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn

from pdserve.sampling_params import RequestOutput, SamplingParams, TokenLogprob
from pdserve.router.http.server import create_app

MODEL = "fake-model"
BOS, EOS = 1, 2


class CharTokenizer:
    """One token per character (its code point); BOS=1 and EOS=2 are the special tokens."""

    has_chat_template = True
    eos_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids if t not in (BOS, EOS))

    def token_to_str(self, token_id: int) -> str:
        return {BOS: "<s>", EOS: "</s>"}.get(token_id, chr(token_id))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if messages[-1]["role"] == "assistant" and add_generation_prompt:
            raise ValueError("the conversation must not end with an assistant message")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def expected_text(prompt_ids: list[int], num_tokens: int, seed: int | None = None) -> str:
    """What FakeBackend generates: letters cycling from a start set by the prompt and the seed."""
    start = sum(prompt_ids) + (seed or 0)
    return "".join(chr(ord("a") + (start + j) % 26) for j in range(num_tokens))


@dataclass
class FakeBackend:
    """Deterministic tokens from the prompt (see expected_text), one per step.

    Prompt markers: "[slow]" makes each step take 0.2 s; "[eos]" makes the 4th token EOS;
    "[cached]" reports its first 5 prompt tokens as prefix-cache hits (num_cached_tokens).
    `fail_with` is raised before the first delta; `fail_after` tokens, `fail_mid` is raised.
    """

    model_name: str = MODEL
    max_model_len: int = 128
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    step_delay_s: float = 0.0
    fail_with: Exception | None = None
    fail_mid: Exception | None = None
    fail_after: int = 2
    healthy: bool = True
    requests: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    live: set[str] = field(default_factory=set)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.requests.append((request_id, list(prompt_token_ids), params))
        if self.fail_with is not None:
            raise self.fail_with
        assert request_id not in self.live, "request ids must be unique among live requests"
        self.live.add(request_id)
        prompt_text = self.tokenizer.decode(prompt_token_ids)
        delay = 0.2 if "[slow]" in prompt_text else self.step_delay_s
        text, emitted, count = "", 0, 0
        start = sum(prompt_token_ids) + (params.seed or 0)
        try:
            for j in range(params.max_tokens):
                await asyncio.sleep(delay)
                if request_id in self.aborted:
                    return
                if self.fail_mid is not None and j == self.fail_after:
                    raise self.fail_mid
                token = EOS if ("[eos]" in prompt_text and j == 3) else ord("a") + (start + j) % 26
                count += 1
                finish = None
                if token == EOS and not params.ignore_eos:
                    finish = "stop"
                else:
                    text += self.tokenizer.decode([token])
                visible = text
                for stop in params.stop:
                    cut = text.find(stop)
                    if cut != -1:
                        visible, finish = text[:cut], "stop"
                if finish is None and count == params.max_tokens:
                    finish = "length"
                logprobs = None
                if params.logprobs is not None:
                    top = [(token + r, -0.5 - r) for r in range(params.logprobs)]
                    logprobs = [TokenLogprob(token_id=token, logprob=-0.5, top=top)]
                yield RequestOutput(
                    request_id=request_id,
                    new_token_ids=[token],
                    new_text=visible[emitted:],
                    finished=finish is not None,
                    finish_reason=finish,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_output_tokens=count,
                    num_cached_tokens=5 if "[cached]" in prompt_text else 0,
                    logprobs=logprobs,
                )
                emitted = len(visible)
                if finish is not None:
                    return
        finally:
            self.live.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> dict[str, Any]:
        if not self.healthy:
            raise RuntimeError("no decode workers")
        return {"workers": 2}


class ServerThread:
    """Serves an app on 127.0.0.1 (port chosen by the OS) from a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="session")
def _shared_backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="session")
def _shared_server(_shared_backend: FakeBackend) -> Iterator[ServerThread]:
    with ServerThread(create_app(_shared_backend)) as server:
        yield server


@pytest.fixture
def backend(_shared_backend: FakeBackend) -> FakeBackend:
    """The one FakeBackend of this session, reset to a fresh state for each test."""
    state = vars(_shared_backend)
    state.clear()
    state.update(vars(FakeBackend()))
    return _shared_backend


@pytest.fixture
def serve(backend: FakeBackend) -> Iterator[Callable[..., ServerThread]]:
    """serve(**create_app_kwargs) -> a running ServerThread for `backend`; stopped after the test."""
    servers: list[ServerThread] = []

    def start(**kwargs: Any) -> ServerThread:
        server = ServerThread(create_app(backend, **kwargs))
        servers.append(server.__enter__())
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture
def server(_shared_server: ServerThread, backend: FakeBackend) -> ServerThread:
    """The app with default settings, shared by the session (its metrics accumulate: use serve() to count)."""
    return _shared_server


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()
