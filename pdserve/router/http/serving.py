"""OpenAI completions and chat completions on top of a `GenerationBackend`.

A request goes through:
1. parse (`pdserve.router.http.protocol`, `.responses`), validate and prepare one `Job` per
   choice (`pdserve.router.http.preparation`);
2. run the jobs on the backend through a `FanOut`;
3. answer as one JSON body, or as SSE events that OpenAI's clients read (the formatter's:
   `pdserve.router.http.formatting`, `.responses`).

The HTTP status of a streamed response is decided by the first backend delta: errors before
it are ordinary error responses; errors after it become an SSE `{"error": ...}` event.
A client that goes away (while waiting or mid-stream) gets its backend requests aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal, TypeVar

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from pdserve.sampling_params import RequestOutput
from pdserve.timing import RequestTiming
from pdserve.router.backend import GenerationBackend
from pdserve.router.errors import APIError, ClientDisconnected, as_api_error
from pdserve.router.http.fanout import FanOut
from pdserve.router.http.formatting import ChatFormatter, ChoiceText, CompletionFormatter, Formatter, sse
from pdserve.router.metrics import RequestStatus, RouterMetrics
from pdserve.router.http.preparation import prepare_chat, prepare_completion
from pdserve.router.http.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from pdserve.router.http.responses import ResponsesFormatter, ResponsesRequest, prepare_responses

logger = logging.getLogger(__name__)

Endpoint = Literal["completions", "chat", "responses"]
TIMING_HEADER = "x-pdserve-timing"  # "1" (or "true"): the request asks for usage.pdserve_timing
T = TypeVar("T")


# ---------------------------------------------------------------- transport


class EventStreamResponse(Response):
    """Sends SSE events while watching for the client to leave, whatever the server's ASGI version.

    `on_close(completed)` runs exactly once, shielded from cancellation; completed is False when
    the client went away (or the stream broke) before the last event was sent.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[bool], Awaitable[None]]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        completed = False
        try:
            async with anyio.create_task_group() as tasks:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tasks.cancel_scope.cancel()

                tasks.start_soon(watch_disconnect)
                try:
                    await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                    async for event in self.events:
                        await send({"type": "http.response.body", "body": event, "more_body": True})
                    completed = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the transport broke under a send: the client is gone
                    completed = False
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()  # type: ignore[attr-defined]
                await self.on_close(completed)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, raising ClientDisconnected (and cancelling it) if the client leaves first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        raise ClientDisconnected
    finally:
        for task in (work_task, watch_task):
            task.cancel()


# ---------------------------------------------------------------- the service


class OpenAIServing:
    def __init__(self, backend: GenerationBackend, metrics: RouterMetrics, request_timeout_s: float | None = None,
                 max_tokens_default: int | None = None, usage_timing: bool = False) -> None:
        self.backend = backend
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.max_tokens_default = max_tokens_default  # a request's max_tokens when it gives none (None: OpenAI's)
        self.usage_timing = usage_timing  # usage.pdserve_timing for every request, asked for or not

    def wants_timing(self, request: Request, req: ChatCompletionRequest | CompletionRequest | ResponsesRequest) -> bool:
        """usage.pdserve_timing is opt-in: clients that validate `usage` see only OpenAI's fields."""
        header = request.headers.get(TIMING_HEADER, "").strip().lower()
        return self.usage_timing or getattr(req, "pdserve_timing", False) or header in ("1", "true", "yes", "on")

    async def handle(self, endpoint: Endpoint, request: Request, request_id: str) -> Response:
        arrival = time.monotonic()
        try:
            body = await request.body()
            # templates and tokenizers are CPU work: keep them off the event loop that streams tokens
            if endpoint == "chat":
                chat_req = parse_request(ChatCompletionRequest, body)
                prepared = await anyio.to_thread.run_sync(
                    prepare_chat, chat_req, self.backend, request_id, self.max_tokens_default)
                formatter: Formatter = ChatFormatter(prepared, self.backend.model_name,
                                                     self.backend.tokenizer.token_to_str)
                timing = self.wants_timing(request, chat_req)
            elif endpoint == "responses":
                responses_req = parse_request(ResponsesRequest, body)
                prepared = await anyio.to_thread.run_sync(
                    prepare_responses, responses_req, self.backend, request_id, self.max_tokens_default)
                formatter = ResponsesFormatter(prepared, self.backend.model_name, self.backend.tokenizer.token_to_str,
                                               responses_req)
                timing = self.wants_timing(request, responses_req)
            else:
                completion_req = parse_request(CompletionRequest, body)
                prepared = await anyio.to_thread.run_sync(
                    prepare_completion, completion_req, self.backend, request_id, self.max_tokens_default)
                formatter = CompletionFormatter(prepared, self.backend.model_name, self.backend.tokenizer.token_to_str)
                timing = self.wants_timing(request, completion_req)
        except APIError:
            self.metrics.requests.labels(endpoint, RequestStatus.ERROR).inc()
            raise
        self.metrics.prompt_tokens.inc(prepared.num_prompt_tokens)
        deadline = None if self.request_timeout_s is None else arrival + self.request_timeout_s
        fanout = FanOut(self.backend, prepared.jobs, deadline=deadline)
        fanout.start()
        try:
            if prepared.stream:
                first = await unless_disconnected(request, fanout.next())
            else:
                choices = await unless_disconnected(request, self._collect(fanout))
        except BaseException as exc:
            gone = isinstance(exc, (ClientDisconnected, asyncio.CancelledError))
            status = RequestStatus.ABORTED if gone else RequestStatus.ERROR
            await self._finish(endpoint, fanout, arrival, status)
            if isinstance(exc, ClientDisconnected):
                return Response(status_code=499)  # nobody is listening
            if isinstance(exc, Exception):
                raise as_api_error(exc) from exc
            raise
        if not prepared.stream:
            await self._finish(endpoint, fanout, arrival, RequestStatus.OK)
            usage = formatter.usage(fanout.num_output_tokens, fanout.timings() if timing else None,
                                    fanout.num_cached_tokens)
            return JSONResponse(formatter.response(choices, usage).model_dump(mode="json"))

        outcome = {"status": RequestStatus.OK}

        async def on_close(completed: bool) -> None:
            await self._finish(endpoint, fanout, arrival, outcome["status"] if completed else RequestStatus.ABORTED)

        assert first is not None
        events = self._events(formatter, fanout, first, outcome, timing)
        return EventStreamResponse(events, on_close)

    async def warm_up(self, timeout_s: float = 30.0) -> float:
        """Pays the first request's one-time costs before serving (seconds spent): request
        parsing, the tokenizer and chat template on a thread of the pool requests use, chunk
        formatting and JSON encoding, then the backend's own (`warm_up(prompt_token_ids)` where it
        has one: the cluster backend sends each worker a one-token Generate). Nothing here counts
        in the metrics; a part that fails is logged and skipped."""
        t = time.perf_counter()
        model = getattr(self.backend, "model_name", "model")
        bodies: list[tuple[Endpoint, bytes]] = [
            ("completions", json.dumps({"model": model, "prompt": "Warm up.", "max_tokens": 1, "stream": True,
                                        "stream_options": {"include_usage": True}}).encode()),
            ("chat", json.dumps({"model": model, "messages": [{"role": "user", "content": "Warm up."}],
                                 "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}}).encode()),
        ]
        prompt: list[int] | None = None
        for endpoint, body in bodies:
            try:
                if endpoint == "chat":
                    prepared = await anyio.to_thread.run_sync(
                        prepare_chat, parse_request(ChatCompletionRequest, body), self.backend, "warmup", None)
                    formatter: Formatter = ChatFormatter(prepared, model, self.backend.tokenizer.token_to_str)
                else:
                    prepared = await anyio.to_thread.run_sync(
                        prepare_completion, parse_request(CompletionRequest, body), self.backend, "warmup", None)
                    formatter = CompletionFormatter(prepared, model, self.backend.tokenizer.token_to_str)
                job = prepared.jobs[0]
                prompt = prompt or list(job.prompt_token_ids)
                token = job.prompt_token_ids[-1]
                output = RequestOutput(job.request_id, [token], "up", True, "length", len(job.prompt_token_ids), 1)
                chunks = [*formatter.start_chunks(), *formatter.delta_chunks(job.index, output),
                          formatter.usage_chunk(formatter.usage(1, {job.index: RequestTiming(first_token_s=0.0)}))]
                for chunk in chunks:
                    sse(chunk.model_dump_json())
            except Exception as exc:  # a backend without a chat template, say
                logger.info("router warm-up: %s skipped (%s)", endpoint, exc)
        try:  # the grammar engine's import and a first schema check (structured outputs)
            from pdserve.router.http.structured import checked
            from pdserve.structured.spec import StructuredOutput

            await anyio.to_thread.run_sync(checked, StructuredOutput.json_schema({"type": "object"}), "warmup")
        except Exception as exc:
            logger.info("router warm-up: the structured-output check skipped (%s)", exc)
        warm = getattr(self.backend, "warm_up", None)
        if warm is not None and prompt:
            try:
                await asyncio.wait_for(warm(prompt), timeout_s)
            except Exception as exc:
                logger.warning("router warm-up: the backend's part failed (%s)", exc)
        seconds = time.perf_counter() - t
        logger.info("router warm-up in %.2fs", seconds)
        return seconds

    async def _collect(self, fanout: FanOut) -> dict[int, ChoiceText]:
        choices = {job.index: ChoiceText() for job in fanout.jobs}
        async for index, output in fanout:
            choice = choices[index]
            choice.text.append(output.new_text)
            choice.logprobs.extend(output.logprobs or ())
            if output.finished:
                choice.finish_reason = output.finish_reason or "stop"
        return choices

    async def _events(
        self, formatter: Formatter, fanout: FanOut, first: tuple[int, RequestOutput], outcome: dict[str, str],
        timing: bool = False,
    ) -> AsyncIterator[bytes]:
        encode = formatter.encode
        # one body message per delta (the start chunks go with the first): one write and one TCP
        # segment where a chat's first delta would take two
        start = b"".join(encode(chunk) for chunk in formatter.start_chunks())
        item: tuple[int, RequestOutput] | None = first
        try:
            while item is not None:
                events = b"".join(encode(chunk) for chunk in formatter.delta_chunks(*item))
                if start:
                    events, start = start + events, b""
                if events:
                    yield events
                item = await fanout.next()
        except Exception as exc:
            outcome["status"] = RequestStatus.ERROR
            yield start + formatter.error_event(as_api_error(exc).to_dict())
            return
        timings = fanout.timings() if timing else None
        yield start + formatter.end_events(formatter.usage(fanout.num_output_tokens, timings, fanout.num_cached_tokens))

    async def _finish(self, endpoint: Endpoint, fanout: FanOut, arrival: float, status: str) -> None:
        await fanout.close()
        self.metrics.requests.labels(endpoint, status).inc()
        for job in fanout.jobs:
            progress = fanout.progress[job.index]
            if progress.first_token_at is not None:  # prefilled: its prompt was looked up in the cache
                self.metrics.observe_prefix_cache(prompt_tokens=len(job.prompt_token_ids),
                                                  cached_tokens=progress.num_cached_tokens)
        for progress in fanout.progress.values():
            if progress.finished:
                self.metrics.observe_choice(
                    arrival=arrival,
                    first_token=progress.first_token_at,
                    last_token=progress.last_token_at,
                    num_output_tokens=progress.num_output_tokens,
                )
            else:
                self.metrics.generation_tokens.inc(progress.num_output_tokens)
