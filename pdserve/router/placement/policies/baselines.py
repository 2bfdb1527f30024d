"""Baseline policies beside round-robin and least-loaded: random, power-of-two, prefix-aware.

All are seeded or deterministic, so that one loadgen run replays the same decisions.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from pdserve.router.placement.base import (ClusterSnapshot, PoolPolicy, Purpose, RequestInfo, WorkerSnapshot,
                                           least_loaded_key)


class _Seeded(PoolPolicy):
    """A pool policy drawing from its own generator, seeded with `seed`."""

    def __init__(self, *, seed: int = 0, local_prefill_max_tokens: int = 0) -> None:
        super().__init__(local_prefill_max_tokens=local_prefill_max_tokens)
        _check_seed(seed)
        self.seed = seed
        self._rng = random.Random(seed)


class RandomChoice(_Seeded):
    """A uniformly random worker of each pool, from a generator seeded with `seed`."""

    name = "random"

    def pick(
        self, candidates: Sequence[WorkerSnapshot], purpose: Purpose, request: RequestInfo, snapshot: ClusterSnapshot
    ) -> WorkerSnapshot:
        return candidates[self._rng.randrange(len(candidates))]


class PowerOfTwo(_Seeded):
    """Two distinct random workers of the pool (seeded); the less loaded of them
    (least-loaded's order: load, then free KV fraction, then worker id)."""

    name = "power-of-two"

    def pick(
        self, candidates: Sequence[WorkerSnapshot], purpose: Purpose, request: RequestInfo, snapshot: ClusterSnapshot
    ) -> WorkerSnapshot:
        if len(candidates) == 1:
            return candidates[0]
        return min(self._rng.sample(list(candidates), 2), key=least_loaded_key)


class PrefixIndex:
    """Which worker last took each prompt prefix: a bounded LRU map.

    A prompt's keys are a hash chain over its first `max_blocks` full blocks of `block_size`
    tokens (key i covers blocks 0..i, as a prefix cache does), so the longest shared prefix
    wins. Python hashes tuples of ints deterministically, so decisions replay across runs.
    """

    def __init__(self, *, block_size: int = 16, max_blocks: int = 8, capacity: int = 100_000) -> None:
        for name, value in (("block_size", block_size), ("max_blocks", max_blocks), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        bs = self.block_size
        chain, h = [], 0
        for i in range(min(len(token_ids) // bs, self.max_blocks)):
            h = hash((h, tuple(token_ids[i * bs:(i + 1) * bs])))
            chain.append(h)
        return chain

    def longest(self, keys: Sequence[int], workers: set[str]) -> tuple[str, int] | None:
        """(worker, blocks matched) of the longest prefix owned by one of `workers`."""
        for depth in range(len(keys), 0, -1):
            owner = self._owner.get(keys[depth - 1])
            if owner in workers:
                return owner, depth
        return None

    def matched_blocks(self, keys: Sequence[int], worker_id: str) -> int:
        found = self.longest(keys, {worker_id})
        return found[1] if found else 0

    def depths(self, keys: Sequence[int]) -> dict[str, int]:
        """Blocks matched by each worker that owns a prefix of `keys`: matched_blocks for all at once."""
        found: dict[str, int] = {}
        for depth, key in enumerate(keys, 1):
            owner = self._owner.get(key)
            if owner is not None:
                found[owner] = depth
        return found

    def record(self, keys: Sequence[int], worker_id: str) -> None:
        for key in keys:
            self._owner[key] = worker_id
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)


class PrefixAware(PoolPolicy):
    """Requests that share a prompt prefix go to the prefill worker that took it last (its
    prefix cache holds the KV), unless that worker has `max_imbalance` more requests than the
    least loaded one; otherwise, and for decode, least-loaded. A prompt shorter than one block
    has no prefix to share."""

    name = "prefix-aware"

    def __init__(
        self, *, block_size: int = 16, max_prefix_blocks: int = 8, max_entries: int = 100_000,
        max_imbalance: int = 8, local_prefill_max_tokens: int = 0,
    ) -> None:
        super().__init__(local_prefill_max_tokens=local_prefill_max_tokens)
        if isinstance(max_imbalance, bool) or not isinstance(max_imbalance, int) or max_imbalance < 0:
            raise ValueError(f"max_imbalance must be an integer >= 0, got {max_imbalance!r}")
        self.max_imbalance = max_imbalance
        self.index = PrefixIndex(block_size=block_size, max_blocks=max_prefix_blocks, capacity=max_entries)

    def pick(
        self, candidates: Sequence[WorkerSnapshot], purpose: Purpose, request: RequestInfo, snapshot: ClusterSnapshot
    ) -> WorkerSnapshot:
        least = min(candidates, key=least_loaded_key)
        if purpose == "decode":
            return least
        keys = self.index.keys(request.prompt_token_ids)
        if not keys:
            return least
        chosen = least
        found = self.index.longest(keys, {w.worker_id for w in candidates})
        if found is not None:
            owner = next(w for w in candidates if w.worker_id == found[0])
            if owner.load - least.load <= self.max_imbalance:
                chosen = owner
        self.index.record(keys, chosen.worker_id)
        return chosen


def _check_seed(seed: object) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
