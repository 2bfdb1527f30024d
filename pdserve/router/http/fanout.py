"""Runs the backend requests of one HTTP request (one per choice) and merges their deltas.

1. `start` opens one backend stream per `Job`, each pumped by its own task into one queue.
   The queue holds at most QUEUE_PER_JOB deltas per job: a client that reads slowly holds the
   pumps back, so the backend stream (and, through gRPC flow control, the worker, which merges
   what waits) is read only as fast as the client takes it; nothing piles up here.
2. `next` hands out (choice index, delta) in arrival order, raising the first backend error or
   `RequestTimeout` past the deadline; it returns None once every job has finished.
3. `close` aborts every job that has not finished (client gone, error, timeout) and stops the
   pumps. It is idempotent and runs to the end even while its caller is being cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from pdserve.sampling_params import RequestOutput, SamplingParams
from pdserve.timing import RequestTiming
from pdserve.router.backend import GenerationBackend
from pdserve.router.errors import InternalError, RequestTimeout, ServiceUnavailable

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0
QUEUE_PER_JOB = 2


@dataclass(frozen=True)
class Job:
    index: int  # choice index in the response
    request_id: str  # backend request id, unique per choice
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class JobProgress:
    num_output_tokens: int = 0
    first_token_at: float | None = None  # time.monotonic()
    last_token_at: float | None = None
    finish_reason: str | None = None
    timing: RequestTiming | None = None  # RequestOutput.timing of the finished delta
    num_cached_tokens: int = 0  # prompt tokens its worker found in its prefix cache (the most any delta said)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_END = object()  # a backend stream ended without a finished delta


@dataclass
class FanOut:
    backend: GenerationBackend
    jobs: list[Job]
    deadline: float | None = None  # time.monotonic() past which the request times out
    progress: dict[int, JobProgress] = field(init=False)

    def __post_init__(self) -> None:
        self.progress = {job.index: JobProgress() for job in self.jobs}
        self._queue: asyncio.Queue[tuple[Job, object]] = asyncio.Queue(QUEUE_PER_JOB * max(1, len(self.jobs)))
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    @property
    def num_output_tokens(self) -> int:
        return sum(p.num_output_tokens for p in self.progress.values())

    @property
    def num_cached_tokens(self) -> int:
        return sum(p.num_cached_tokens for p in self.progress.values())

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump(job), name=f"pump-{job.request_id}") for job in self.jobs]

    async def _pump(self, job: Job) -> None:
        stream = self.backend.generate(job.request_id, job.prompt_token_ids, job.params)
        try:
            async for output in stream:
                await self._queue.put((job, output))
                if output.finished:
                    return
            await self._queue.put((job, _END))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which maps it to a response
            await self._queue.put((job, exc))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    @property
    def num_buffered(self) -> int:
        """Deltas received from the backend that the client has not taken yet."""
        return self._queue.qsize()

    def timings(self) -> dict[int, RequestTiming | None]:
        """choice index -> the backend's timing of that choice (None when it gave none)."""
        return {index: p.timing for index, p in self.progress.items()}

    async def next(self) -> tuple[int, RequestOutput] | None:
        if all(p.finished for p in self.progress.values()):
            return None
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            job, item = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            raise RequestTimeout("The request did not finish before its deadline.") from None
        if isinstance(item, BaseException):
            raise item
        if item is _END:
            raise InternalError(f"The backend stream of {job.request_id} ended without finishing.")
        assert isinstance(item, RequestOutput)
        if item.finished and item.finish_reason == "abort":
            raise ServiceUnavailable("The request was aborted by the backend.")
        progress = self.progress[job.index]
        progress.num_cached_tokens = max(progress.num_cached_tokens, item.num_cached_tokens)
        if item.new_token_ids:
            now = time.monotonic()
            progress.first_token_at = progress.first_token_at or now
            progress.last_token_at = now
            progress.num_output_tokens += len(item.new_token_ids)
        if item.finished:
            progress.finish_reason = item.finish_reason or "stop"
            progress.timing = item.timing
        return job.index, item

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while (item := await self.next()) is not None:
            yield item

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        unfinished = [job.request_id for job in self.jobs if not self.progress[job.index].finished]
        with anyio.move_on_after(ABORT_TIMEOUT_S, shield=True):
            await asyncio.gather(*(self._abort(rid) for rid in unfinished))
            for task in self._tasks:
                task.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks)

    async def _abort(self, request_id: str) -> None:
        try:
            await self.backend.abort(request_id)
        except Exception:
            logger.warning("aborting %s failed", request_id, exc_info=True)
