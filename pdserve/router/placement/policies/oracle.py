"""The reference for network-aware's search: every option priced. Pure; no production path uses it.

`Exhaustive` answers the questions router.placement.policies.search.Search answers (the best pair and
the best local run in the policy's order, optionally among the feasible ones; how many pairs
exceed the TPOT SLO or lack free KV blocks) by pricing every (P, D) pair with P != D and every
local run. `OracleNetworkAware` is the policy with it in place of the search: the same rules,
the same estimates, so any difference in a decision or its reason is the search's.
tests/router/test_search.py, tests/sim/test_sim_search.py (through sim.check),
benchmarks/bench_placement.py and `bench_sim.py --check-decisions` compare the two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pdserve.router.placement.base import ClusterSnapshot, RequestInfo, WorkerSnapshot
from pdserve.router.placement.policies.cost import Estimate
from pdserve.router.placement.policies.network_aware import NetworkAware
from pdserve.router.placement.policies.search import Feasible, order


class Exhaustive:
    """Every option priced."""

    def __init__(self, prefills: Sequence[WorkerSnapshot], decodes: Sequence[WorkerSnapshot],
                 pair: Callable[[WorkerSnapshot, WorkerSnapshot], Estimate],
                 local: Callable[[WorkerSnapshot], Estimate]) -> None:
        self.load_map = {w.worker_id: w.load for w in (*prefills, *decodes)}
        self.pairs = [pair(p, d) for d in decodes for p in prefills if p.worker_id != d.worker_id]
        self.locals = [local(d) for d in decodes]
        self.num_pairs = len(self.pairs)

    def best_pair(self, feasible: Feasible | None = None) -> Estimate | None:
        return self._best(self.pairs, feasible)

    def best_local(self, feasible: Feasible | None = None) -> Estimate | None:
        return self._best(self.locals, feasible)

    def count_over_tpot(self, limit: float, factor: float) -> int:
        return sum(1 for e in self.pairs if e.tpot_s * factor > limit)

    def count_without_room(self) -> int:
        return sum(1 for e in self.pairs if not e.room)

    def _best(self, options: list[Estimate], feasible: Feasible | None) -> Estimate | None:
        if feasible is not None:
            options = [e for e in options if feasible(e)]
        return min(options, key=lambda e: order(e, self.load_map), default=None)


class OracleNetworkAware(NetworkAware):
    """Network-aware placement pricing every option: the reference the search is tested against."""

    def _search(self, request: RequestInfo, snapshot: ClusterSnapshot, keys: list[int], prefill_rows: np.ndarray,
                decode_rows: np.ndarray) -> Exhaustive:  # type: ignore[override]
        workers = self._columns.workers
        return Exhaustive([workers[r] for r in prefill_rows.tolist()], [workers[r] for r in decode_rows.tolist()],
                          pair=lambda p, d: self._estimate_pair(request, p, d, snapshot, keys),
                          local=lambda d: self._estimate_local(request, d, keys))
