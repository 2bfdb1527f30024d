"""Placement: a pure function from (request, cluster snapshot) to a decision.

No I/O, no clock, no gRPC: the router builds a `ClusterSnapshot` from what it knows (worker
stats, its own in-flight counts, later topology and link congestion) and asks a policy where
the request goes. The same policies run in a simulator.

Decision kinds:
- "disaggregated": prefill on `prefill`, KV pushed to `decode`, which streams the rest;
- "local": the whole request on `decode` (prefill locally: no prefill worker, a short prompt,
  or a request that resumes tokens generated elsewhere, which only `Generate` can carry);
- "colocated": the whole request on `decode`, in a cluster of mixed workers.

Rules shared by every policy (`PoolPolicy`):
1. Candidates are healthy workers, not excluded for this request, whose capacity fits it.
2. Colocated mode: a decode-capable worker (mixed, or decode) runs the whole request.
3. Disaggregated mode: a resumed request, or a prompt of at most `local_prefill_max_tokens`
   tokens, goes local; otherwise a (P, D) pair with P != D; with no prefill worker left, local.
4. Disaggregated mode with no decode-capable worker left (the only one restarts): degraded,
   the whole request runs locally on a prefill worker (`Decision.degraded`).
Policies differ in how they pick within a pool (`pick`) or a pair (`choose_pair`); a policy
that needs the whole picture (network-aware) overrides `place`.

Feedback: when a request finishes, the router (and the simulator) hands the policy an
`Outcome` (where it ran, its measured TTFT and TPOT, the prefill its prefill worker reported)
through `observe_outcome`; the default ignores it. A policy that learns from outcomes
(network-aware calibrates its model, router.placement.policies.calibration) keeps that cheap; the
router logs, and never fails a request on, an exception raised there.

Two baselines live here (round-robin, least-loaded), the others in `pdserve.router.placement.policies`
(random, power-of-two, prefix-aware, network-aware). `pdserve.router.placement.registry` maps policy
names to their classes; nothing here imports it or the policies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pdserve.router.placement.congestion import CongestionView, LinkState
from pdserve.router.placement.topology import Link, Topology

Role = Literal["prefill", "decode", "mixed"]
Mode = Literal["disaggregated", "colocated"]
DecisionKind = Literal["disaggregated", "local", "colocated"]
Purpose = Literal["prefill", "decode", "colocated", "local"]

ROLES: tuple[str, ...] = ("prefill", "decode", "mixed")
MODES: tuple[str, ...] = ("disaggregated", "colocated")


class NoWorkersAvailable(Exception):
    """No healthy worker can take the request."""


class NoCompatiblePair(NoWorkersAvailable):
    """Prefill and decode workers are up, but no prefill worker shares a decode worker's KV
    layout, model or wire version (`WorkerSnapshot.kv_compat`): no KV can move between them."""


class SLOUnattainable(Exception):
    """Admission control: no placement is predicted to meet the SLOs (the backend answers 429)."""


@dataclass(frozen=True)
class WorkerSnapshot:
    """One worker as the router sees it at placement time.

    `num_waiting`/`num_running`/block counts come from the worker's last Stats answer;
    `num_inflight` is the router's own count of requests it has sent there and not seen finish,
    so that load reacts at once, before the next poll. 0 for a block count or `max_model_len`
    means unknown (no capacity check).
    """

    worker_id: str
    role: Role
    node: str = ""
    healthy: bool = True
    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    block_size: int = 0
    num_inflight: int = 0
    max_model_len: int = 0
    tokens_per_second: float = 0.0
    num_inflight_tokens: int = 0  # prompt tokens of the router's in-flight requests there
    # ranks of its engine: a tensor-parallel worker is one unit holding this many GPUs (its KV
    # capacity is already in num_blocks, which counts blocks of every rank's heads)
    tensor_parallel_size: int = 1
    # what a KV peer must share with it (model, dtype, block size, wire version); "" unknown:
    # pairs with any. Only workers of equal keys are paired for a KV hand-off.
    kv_compat: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker {self.worker_id!r}: role must be one of {ROLES}, got {self.role!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"worker {self.worker_id!r}: tensor_parallel_size must be a positive integer, got {tp!r}")

    @property
    def num_gpus(self) -> int:
        """GPUs (ranks) the worker holds: the unit placement counts capacity in."""
        return self.tensor_parallel_size

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "mixed")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "mixed")

    @property
    def load(self) -> int:
        """Requests queued or running there: the worker's count, or the router's own when larger
        (it is larger between a dispatch and the next Stats poll)."""
        return max(self.num_waiting + self.num_running, self.num_inflight)

    @property
    def free_fraction(self) -> float:
        return self.num_free_blocks / self.num_blocks if self.num_blocks else 1.0

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` could ever fit (capacity, not the free blocks of now)."""
        if self.max_model_len and num_tokens > self.max_model_len:
            return False
        if self.num_blocks and self.block_size:
            return -(-num_tokens // self.block_size) <= self.num_blocks
        return True


@dataclass(frozen=True)
class ClusterSnapshot:
    """The workers (and, for later policies, topology and links) at one instant.

    New views of the cluster are added as fields with defaults, so existing policies keep working.
    """

    workers: tuple[WorkerSnapshot, ...]
    mode: Mode = "disaggregated"
    topology: Topology = field(default_factory=Topology)
    links: CongestionView = field(default_factory=CongestionView)
    kv_bytes_per_token: int = 0  # measured from transfers; 0: unknown
    now: float = 0.0  # the router's monotonic clock when the snapshot was taken (seconds)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        ids = [w.worker_id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be unique, got {sorted(ids)}")

    def worker(self, worker_id: str) -> WorkerSnapshot:
        for w in self.workers:
            if w.worker_id == worker_id:
                return w
        raise KeyError(worker_id)

    def node_of(self, worker: WorkerSnapshot) -> str:
        return self.topology.node_of(worker.worker_id, worker.node)

    def link(self, src: WorkerSnapshot, dst: WorkerSnapshot) -> tuple[Link, LinkState]:
        """The link KV takes from `src` to `dst`, and what is on it now."""
        link = self.topology.link(self.node_of(src), self.node_of(dst))
        return link, self.links.state(link.key)


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    prompt_token_ids: tuple[int, ...] = ()  # for prefix-aware policies; may be empty
    num_resumed_tokens: int = 0  # tokens generated elsewhere (migration): only a local run can carry them
    excluded: frozenset[str] = field(default_factory=frozenset)  # workers that already failed this request

    @property
    def num_tokens(self) -> int:
        """Tokens the decode side holds at the end (prompt + everything generated)."""
        return self.num_prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class Decision:
    kind: DecisionKind
    prefill: str | None
    decode: str
    reason: str = ""
    degraded: bool = False  # a prefill worker runs the whole request: no decode-capable worker is up
    # disaggregated: the KV's precision on the wire ("full" | "fp8") and why (network-aware decides;
    # other policies leave "full"); the backend's --kv-wire-precision full|fp8 overrides it
    kv_precision: str = "full"
    kv_precision_reason: str = ""

    def __post_init__(self) -> None:
        if self.kv_precision not in ("full", "fp8"):
            raise ValueError(f"kv_precision must be 'full' or 'fp8', got {self.kv_precision!r}")
        if self.kind == "disaggregated":
            if self.prefill is None or self.prefill == self.decode:
                raise ValueError(f"a disaggregated decision needs a prefill worker other than {self.decode!r}")
        elif self.kind in ("local", "colocated"):
            if self.prefill is not None:
                raise ValueError(f"a {self.kind} decision has no prefill worker, got {self.prefill!r}")
        else:
            raise ValueError(f"unknown decision kind {self.kind!r}")

    @property
    def workers(self) -> tuple[str, ...]:
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)


@dataclass(frozen=True)
class Outcome:
    """What a finished request measured, for the policy that placed it (`observe_outcome`).

    `placement`: where it ran in the end (local covers colocated runs); `ttft_s` from the
    router's receipt of the request to its first token, `tpot_s` the mean time between its
    later tokens (None with fewer than 2); `prefill_s`: the prefill worker's reported prefill
    time, its queue excluded, and `prefill_queue_s` its queue (disaggregated, where known);
    `attempts`: placements it took."""

    request_id: str
    placement: Literal["local", "disaggregated"]
    prefill_worker: str | None
    decode_worker: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    prefill_s: float | None = None
    prefill_queue_s: float | None = None
    attempts: int = 1


class PlacementPolicy(ABC):
    """Chooses where a request runs. Implementations are pure; a tiny internal state
    (a round-robin counter, network-aware's calibration) is allowed, I/O and clocks are not."""

    name: ClassVar[str]
    uses_link_estimates: ClassVar[bool] = False  # it prices links by their measured estimates (the
    # backend then re-probes a link it may be avoiding on an old sample: router.cluster.network)
    topology: Topology | None = None  # set by policies built with a topology file; the backend uses it

    @abstractmethod
    def place(self, request: RequestInfo, snapshot: ClusterSnapshot) -> Decision:
        """Returns the decision; raises NoWorkersAvailable when no healthy worker fits."""

    def observe_outcome(self, outcome: Outcome) -> None:
        """A request this policy placed has finished (module docstring); the default ignores it."""

    def calibration_factors(self) -> dict[str, float]:
        """The factors a learning policy applies to its model now, by name (for gauges); none here."""
        return {}


class PoolPolicy(PlacementPolicy):
    """The shared decision rules (module docstring); subclasses pick within a pool."""

    def __init__(self, *, local_prefill_max_tokens: int = 0) -> None:
        if not isinstance(local_prefill_max_tokens, int) or local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be an integer >= 0, got {local_prefill_max_tokens!r}")
        self.local_prefill_max_tokens = local_prefill_max_tokens

    @abstractmethod
    def pick(
        self, candidates: Sequence[WorkerSnapshot], purpose: Purpose, request: RequestInfo, snapshot: ClusterSnapshot
    ) -> WorkerSnapshot:
        """One of `candidates` (never empty, ordered by worker_id) for `purpose`."""

    def choose_pair(
        self,
        prefills: Sequence[WorkerSnapshot],
        decodes: Sequence[WorkerSnapshot],
        request: RequestInfo,
        snapshot: ClusterSnapshot,
    ) -> tuple[WorkerSnapshot, WorkerSnapshot] | None:
        """A (P, D) pair with P != D, or None when no pair exists. Default: D first, then P."""
        decode = self.pick(decodes, "decode", request, snapshot)
        others = [w for w in prefills if w.worker_id != decode.worker_id]
        if not others:
            return None
        return self.pick(others, "prefill", request, snapshot), decode

    def place(self, request: RequestInfo, snapshot: ClusterSnapshot) -> Decision:
        usable = sorted(
            (w for w in snapshot.workers if w.healthy and w.worker_id not in request.excluded),
            key=lambda w: w.worker_id,
        )
        decodes = [w for w in usable if w.can_decode and w.fits(request.num_tokens)]
        # degraded only when every decode-capable worker is down (not merely full or excluded)
        if snapshot.mode == "disaggregated" and not any(w.can_decode and w.healthy for w in snapshot.workers):
            standins = [w for w in usable if w.role == "prefill" and w.fits(request.num_tokens)]
            if standins:
                worker = self.pick(standins, "local", request, snapshot)
                return Decision("local", None, worker.worker_id, "degraded: no healthy decode-capable worker; "
                                "a prefill worker runs the whole request", degraded=True)
        if not decodes:
            raise NoWorkersAvailable(_none_left("decode-capable", snapshot, request))
        if snapshot.mode == "colocated":
            worker = self.pick(decodes, "colocated", request, snapshot)
            return Decision("colocated", None, worker.worker_id, "colocated mode")
        if request.num_resumed_tokens:
            return self._local(decodes, request, snapshot, "resumed tokens need a local run")
        if request.num_prompt_tokens <= self.local_prefill_max_tokens:
            return self._local(
                decodes, request, snapshot,
                f"short prompt ({request.num_prompt_tokens} <= {self.local_prefill_max_tokens} tokens)",
            )
        prefills = [w for w in usable if w.can_prefill and w.fits(request.num_prompt_tokens)]
        prefills, decodes = compatible_pools(prefills, decodes)
        return self.decide(prefills, decodes, request, snapshot)

    def decide(
        self,
        prefills: Sequence[WorkerSnapshot],
        decodes: Sequence[WorkerSnapshot],
        request: RequestInfo,
        snapshot: ClusterSnapshot,
    ) -> Decision:
        """Disaggregated mode, a request that may go either way: a pair, or local when no pair
        exists. `prefills` may be empty; `decodes` is not."""
        pair = self.choose_pair(prefills, decodes, request, snapshot) if prefills else None
        if pair is None:
            return self._local(decodes, request, snapshot, "no healthy prefill worker")
        prefill, decode = pair
        return Decision("disaggregated", prefill.worker_id, decode.worker_id, f"{self.name} pair")

    def _local(
        self, decodes: Sequence[WorkerSnapshot], request: RequestInfo, snapshot: ClusterSnapshot, reason: str
    ) -> Decision:
        return Decision("local", None, self.pick(decodes, "local", request, snapshot).worker_id, reason)


def kv_keys_pair(a: str, b: str) -> bool:
    """Whether workers of `kv_compat` keys `a` and `b` can move KV between them (an empty key
    matches any)."""
    return not a or not b or a == b


def compatible_pools(
    prefills: Sequence[WorkerSnapshot], decodes: Sequence[WorkerSnapshot]
) -> tuple[list[WorkerSnapshot], list[WorkerSnapshot]]:
    """The prefill and decode workers that can be paired: those whose `kv_compat` keys match (an
    empty key matches any). With several groups of matching keys, the group of the least-loaded
    decode worker. Raises NoCompatiblePair when both pools are non-empty and no key is shared."""
    prefills, decodes = list(prefills), list(decodes)
    keys = {w.kv_compat for w in (*prefills, *decodes)} - {""}
    if len(keys) <= 1 or not prefills:
        return prefills, decodes

    def pairs_with(key: str, w: WorkerSnapshot) -> bool:
        return kv_keys_pair(key, w.kv_compat)

    # a decode worker that can pair with some prefill worker other than itself
    pairable = [d for d in decodes if any(pairs_with(d.kv_compat, p) for p in prefills if p.worker_id != d.worker_id)]
    if not pairable:
        mixed_only = all(p.worker_id in {d.worker_id for d in decodes} for p in prefills)
        if mixed_only and len(prefills) == 1:
            return prefills, decodes  # the one worker pairs with nobody anyway: the policy goes local
        raise NoCompatiblePair(
            "no prefill worker can hand KV to a decode worker: they differ in "
            + "; ".join([f"prefill {p.worker_id} has {p.kv_compat or '?'}" for p in prefills]
                        + [f"decode {d.worker_id} has {d.kv_compat or '?'}" for d in decodes]))
    key = min(pairable, key=least_loaded_key).kv_compat
    return ([p for p in prefills if pairs_with(key, p)], [d for d in decodes if pairs_with(key, d)])


def _none_left(what: str, snapshot: ClusterSnapshot, request: RequestInfo) -> str:
    total = len(snapshot.workers)
    healthy = sum(w.healthy for w in snapshot.workers)
    excluded = f", {len(request.excluded)} excluded for this request" if request.excluded else ""
    return (f"no healthy {what} worker fits request {request.request_id} "
            f"({request.num_tokens} tokens; {healthy}/{total} workers healthy{excluded})")


# ---------------------------------------------------------------- policies

class RoundRobin(PoolPolicy):
    """Cycles through each pool in worker-id order, one counter per purpose."""

    name = "round-robin"

    def __init__(self, *, local_prefill_max_tokens: int = 0) -> None:
        super().__init__(local_prefill_max_tokens=local_prefill_max_tokens)
        self._counters: dict[str, int] = {}

    def pick(
        self, candidates: Sequence[WorkerSnapshot], purpose: Purpose, request: RequestInfo, snapshot: ClusterSnapshot
    ) -> WorkerSnapshot:
        key = "decode" if purpose == "local" else purpose  # local runs share the decode rotation
        turn = self._counters.get(key, 0)
        self._counters[key] = turn + 1
        return candidates[turn % len(candidates)]


class LeastLoaded(PoolPolicy):
    """The worker with the fewest queued and running requests; ties go to the one with the
    larger free KV fraction, then to the smaller worker id."""

    name = "least-loaded"

    def pick(
        self, candidates: Sequence[WorkerSnapshot], purpose: Purpose, request: RequestInfo, snapshot: ClusterSnapshot
    ) -> WorkerSnapshot:
        return min(candidates, key=least_loaded_key)


def least_loaded_key(w: WorkerSnapshot) -> tuple[float, float, str]:
    """Load per GPU (a tensor-parallel worker of N GPUs takes N times the requests), then the
    free KV fraction, then the id."""
    return (w.load / w.num_gpus, -w.free_fraction, w.worker_id)
