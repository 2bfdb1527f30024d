"""The cluster backend's warm-up: the first request's one-time costs, paid before the router serves.

1. every healthy worker gets a one-token Generate: the router's gRPC stream path and the worker's
   (its Generate handler, the engine thread's first step) are warm for the first real request;
2. every prefill -> decode pair moves a first two-token request's KV, WARM_PASSES times per wire
   precision the router may use: a pair's first transfers open its connection, map the peer's
   pools and compile the copy kernels (docs/results.md, "Figures behind the code's choices");
3. from then on a worker that joins (or moves to a new address) is left out of placement until
   its pairs are warmed, at most WARM_JOINER_TIMEOUT_S; one back after a failed check is warmed
   while it serves.

None of it is counted in the metrics or the placement's counters; a worker or pair that fails is
logged and skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from pdserve.router.cluster.flight import Aborter
from pdserve.router.cluster.worker_pool import WorkerPool
from pdserve.router.placement.base import kv_keys_pair
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARM_PAIRS_MAX = 64  # KV pairs a warm-up covers (at start: the first ones; later: a joiner's)
WARM_PAIRS_CONCURRENCY = 8
WARM_PASSES = 2  # per pair and wire precision: the link's first transfer goes staged, the next pulled
WARM_JOINER_TIMEOUT_S = 10.0  # a new worker is placed after this even if a pair is still warming


def _kv_compat(worker) -> str:
    return worker.stats.kv_compat if worker.stats else ""


class WarmUp:
    """Warms the workers of `pool` and their KV pairs (module docstring). `precisions()`: the wire
    precisions the router may use now; the joiners' warm-ups run as `aborter`'s tasks."""

    def __init__(self, pool: WorkerPool, aborter: Aborter, precisions: Callable[[], list[str]], *, mode: str,
                 kv_deadline_s: float, rpc_timeout_s: float) -> None:
        self.pool = pool
        self.aborter = aborter
        self.precisions = precisions
        self.mode = mode
        self.kv_deadline_s = kv_deadline_s
        self.rpc_timeout_s = rpc_timeout_s
        self._prompt: list[int] = []
        self._closed = False

    def close(self) -> None:
        """No joiner is warmed from now on."""
        self._closed = True

    async def warm_up(self, prompt_token_ids: list[int]) -> None:
        """Sends every healthy worker a one-token Generate of `prompt_token_ids` (short: it must not
        fill a KV block the prefix cache would keep), then warms every pair (`warm_pairs`); joiners
        are warmed from then on. A worker that fails is logged."""
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        async def one(worker) -> None:
            try:
                wire_id = f"__warmup-router-{worker.worker_id}"
                async for _ in worker.client.generate(wire_id, prompt_token_ids, params, []):
                    pass
            except Exception as exc:
                logger.warning("warm-up Generate on worker %s failed: %s", worker.worker_id, exc)

        await asyncio.gather(*(one(w) for w in list(self.pool.workers.values()) if w.healthy))
        # joiners are warmed from now on, also if the caller's time runs out in the pairs below
        self._prompt = list(prompt_token_ids)
        self.pool.on_healthy = self._warm_joiner
        await self.warm_pairs(prompt_token_ids)

    async def warm_pairs(self, prompt_token_ids: list[int], joiner: str | None = None) -> int:
        """Moves a first KV block over each prefill -> decode pair (of `joiner` only, when given;
        at most WARM_PAIRS_MAX) before placement uses it: a two-token request, Reserve on D,
        Prefill on P with its KV pushed to D, Decode on D, WARM_PASSES times per wire precision
        the router may use. Returns the pairs warmed."""
        pairs = self._pairs_to_warm(joiner)
        if not pairs:
            return 0
        precisions = self.precisions()
        limit = asyncio.Semaphore(WARM_PAIRS_CONCURRENCY)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

        async def pair(prefill, decode) -> bool:
            async with limit:
                for precision in precisions:
                    for n in range(WARM_PASSES):
                        wire_id = f"__warmup-kv-{prefill.worker_id}-{decode.worker_id}-{precision}-{n}"
                        if not await self._warm_once(prefill, decode, wire_id, prompt_token_ids, params, precision):
                            return False
                return True

        done = await asyncio.gather(*(pair(p, d) for p, d in pairs))
        logger.info("KV pairs warmed: %d of %d%s", sum(done), len(pairs), f" (joiner {joiner})" if joiner else "")
        return sum(done)

    def _pairs_to_warm(self, joiner: str | None) -> list[tuple[Any, Any]]:
        if self.mode == "colocated":
            return []
        workers = [w for w in self.pool.workers.values()
                   if w.healthy and not w.draining and (not w.warming or w.worker_id == joiner)]

        pairs = [(p, d) for p in workers if p.endpoint.role in ("prefill", "mixed")
                 for d in workers if d.endpoint.role in ("decode", "mixed")
                 and p is not d and kv_keys_pair(_kv_compat(p), _kv_compat(d))
                 and joiner in (None, p.worker_id, d.worker_id)]
        return pairs[:WARM_PAIRS_MAX]

    async def _warm_once(self, prefill, decode, wire_id: str, prompt: list[int], params: SamplingParams,
                         precision: str) -> bool:
        parts = [(decode.client, wire_id)]
        finished = False
        try:
            reservation = await decode.client.reserve(wire_id, prompt, params, self.kv_deadline_s + self.rpc_timeout_s,
                                                      timeout_s=self.kv_deadline_s + self.rpc_timeout_s)
            parts.append((prefill.client, wire_id))
            result = await prefill.client.prefill(wire_id, prompt, params, reservation, self.kv_deadline_s,
                                                  timeout_s=self.kv_deadline_s + self.rpc_timeout_s,
                                                  kv_precision=precision)
            parts.remove((prefill.client, wire_id))
            if not result.first.finished:
                async for output in decode.client.decode(wire_id, result.first):
                    if output.finished:
                        break
                finished = True
        except Exception as exc:
            logger.info("warm-up of KV pair %s -> %s (%s) failed: %s", prefill.worker_id, decode.worker_id,
                        precision, exc)
        finally:
            if not finished:
                await self.aborter.abort_parts(parts)
        return finished

    def _warm_joiner(self, worker, joined: bool) -> None:
        """WorkerPool.on_healthy: a worker that joined (or moved to a new address) is left out of
        placement until its KV pairs are warmed (at most WARM_JOINER_TIMEOUT_S); one back after a
        failed check (a restart at the same address looks the same) is warmed while it serves."""
        if self._closed or not self._pairs_to_warm(worker.worker_id):
            return
        worker.warming = joined

        async def warm() -> None:
            try:
                await asyncio.wait_for(self.warm_pairs(self._prompt, joiner=worker.worker_id),
                                       WARM_JOINER_TIMEOUT_S)
            except Exception as exc:
                logger.warning("warm-up of worker %s's KV pairs: %s", worker.worker_id, exc or type(exc).__name__)
            finally:
                worker.warming = False

        self.aborter.spawn(warm())
