"""A live request on the cluster (`Flight`), its parts on the workers, and their release (`Aborter`).

A part is one worker's share of a request: (its client, the worker-side request id). Worker-side
ids are "<request_id>" for the first attempt and "<request_id>.<n>" after (`Flight.next_wire_id`).
A request that ends any other way than finished sends Abort to every worker that holds a part of
it, bounded in time; the Aborts run to their end even when the request's task is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.router.cluster.worker_client import WorkerClient
from pdserve.router.cluster.worker_pool import WorkerPool
from pdserve.router.errors import WorkerFailed
from pdserve.sampling_params import RequestOutput
from pdserve.timing import RequestTiming

logger = logging.getLogger(__name__)

# (client, worker-side request id) of one worker's part in a request
Part = tuple[WorkerClient, str]


@dataclass
class Flight:
    """A live request: what it holds where, and what the client has already received."""

    request_id: str
    num_prompt_tokens: int
    aborted: bool = False
    num_attempts: int = 0
    parts: dict[str, Part] = field(default_factory=dict)  # worker id -> part
    sent_token_ids: list[int] = field(default_factory=list)
    timing: RequestTiming | None = None  # of the attempt that produced the first token
    placed_at: float | None = None  # time.monotonic() when the current attempt was placed

    def time(self, **measured: Any) -> None:
        """Adds `measured` (RequestTiming fields) to the request's timing."""
        self.timing = replace(self.timing or RequestTiming(), **measured)

    def next_wire_id(self) -> str:
        n = self.num_attempts
        self.num_attempts += 1
        return self.request_id if n == 0 else f"{self.request_id}.{n}"

    def aborted_output(self) -> RequestOutput:
        """The last output of a request the client aborted."""
        return RequestOutput(
            request_id=self.request_id, new_token_ids=[], new_text="", finished=True, finish_reason="abort",
            num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=len(self.sent_token_ids),
        )

    def worker_aborted(self, output: RequestOutput) -> bool:
        """A worker that ends a request with "abort" on its own (draining, dying) failed it."""
        return output.finished and output.finish_reason == "abort" and not self.aborted


class Aborter:
    """Best-effort Aborts of parts, and the backend's other background tasks (`spawn`), which
    `wait` gives a bounded time at close."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self._tasks: set[asyncio.Task[Any]] = set()

    async def abort_parts(self, parts: Sequence[Part]) -> None:
        """Best-effort Abort on each part, each bounded by the client's rpc timeout; finishes even if
        the caller is cancelled."""
        if not parts:
            return
        task = self.spawn(asyncio.gather(*(self._abort_one(client, wire_id) for client, wire_id in parts)))
        await asyncio.shield(task)

    async def _abort_one(self, client: WorkerClient, wire_id: str) -> None:
        try:
            await client.abort(wire_id)
        except Exception as exc:
            # it may never have reached the worker (stopped, unreachable, its channel closed as it
            # left the directory): the worker's next good poll sends it again (WorkerPool.abort_later)
            logger.info("abort of %s on worker %s failed: %s", wire_id, client.worker_id, exc)
            if isinstance(exc, WorkerFailed):
                self.pool.abort_later(client.worker_id, wire_id)

    def spawn(self, awaitable: Any) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for the tasks still running."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
