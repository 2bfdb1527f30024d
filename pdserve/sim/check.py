"""Network-aware's search and its oracle side by side in one simulation: every decision compared.

`CheckedNetworkAware` places each request with the policy (its search,
router.placement.policies.search) and, on the same snapshot, with a second policy object that prices
every option (router.placement.policies.oracle); both see every outcome, so their calibration
stays in step. The first decision (kind, workers, reason with its predicted
numbers) or refusal that differs raises `DecisionMismatch`; `checked` counts the placements
compared. The simulation then runs as on the policy alone, so a run with the check
makes the same events as one without it.

    python -m benchmarks.bench_sim --workers 64 --requests 2000 \
        --policy network-aware --check-decisions

(the oracle prices every pair: at 1,000 workers a few seconds a placement)
"""

from __future__ import annotations

from pdserve.router.placement.base import (
    ClusterSnapshot, Decision, NoWorkersAvailable, Outcome, RequestInfo, SLOUnattainable,
)
from pdserve.router.placement.policies.network_aware import NetworkAware
from pdserve.router.placement.policies.oracle import OracleNetworkAware
from pdserve.sim.config import ClusterConfig


class DecisionMismatch(AssertionError):
    """The search and its oracle decided differently."""


class CheckedNetworkAware(NetworkAware):
    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.reference = OracleNetworkAware(**options)
        self.checked = 0

    def place(self, request: RequestInfo, snapshot: ClusterSnapshot) -> Decision:
        found: list[Decision | Exception] = []
        for policy in (super(), self.reference):
            try:
                found.append(policy.place(request, snapshot))
            except (SLOUnattainable, NoWorkersAvailable) as exc:
                found.append(exc)
        mine, reference = found
        same = (type(mine) is type(reference) and str(mine) == str(reference)) if isinstance(mine, Exception) \
            else mine == reference
        if not same:
            raise DecisionMismatch(f"request {request.request_id} (placement {self.checked + 1}): search "
                                   f"{mine!r}, oracle {reference!r}")
        self.checked += 1
        if isinstance(mine, Exception):
            raise mine
        return mine

    def observe_outcome(self, outcome: Outcome) -> None:
        super().observe_outcome(outcome)
        self.reference.observe_outcome(outcome)


def checked_policy(config: ClusterConfig) -> CheckedNetworkAware:
    """The checked policy with the options sim.cluster.build_sim_policy gives network-aware."""
    options = dict(config.router.policy_options.get(NetworkAware.name, {}))
    options.setdefault("profile", config.profile)
    options.setdefault("topology", config.topology)
    return CheckedNetworkAware(**options)
