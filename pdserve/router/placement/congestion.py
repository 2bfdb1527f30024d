"""Link congestion: what is on each link now, and what the link has been measured to carry.

Two halves:
- `CongestionView` / `LinkState` (frozen): what a placement snapshot carries, per link key
  ("src->dst", see router.placement.topology): bytes in flight, active flows, and the measured estimate.
- `LinkMonitor` (mutable, router-side, no clock): the router calls `start` when it sends a
  Prefill for a P->D pair (bytes = prompt tokens x KV bytes per token) and `finish` when the
  Prefill returns, with the kv_bytes / kv_seconds / prefill_seconds the prefill worker reports.

Bandwidth model (`available_gbps`): flows on a link share it fairly (what TCP and UCX
streams do to first order), so a new flow gets

    usable / (active_flows + 1),   usable = min(capacity, measured estimate)

The router knows how many flows it started but not their instantaneous rates, so a
"capacity minus in-flight rate" model would need rates it does not have; counting flows needs
only what the router sees.

Measured estimate: an EWMA (weight `alpha` for the newest sample) of the link throughput that
real transfers achieved. A transfer that shared the link with k flows at most saw about 1/k
of it, so its rate is scaled by that peak k. A transfer that ended about when its prefill
compute did (kv_seconds <= (1 + compute_slack) x prefill_seconds) was paced by the compute,
not by the link: P pushes each layer as it is computed, so such a transfer lasts as long as
the prefill plus the last layer's push and the ACK (which a busy host delays further). Its
rate is only a lower bound, which may raise the estimate but never lower it (and is ignored
before the first real sample, so that a compute-bound transfer never makes a fast link look
slow). Without the slack, a transfer that outlasted its compute by a few percent counted as
a link measurement of about the compute's KV rate: on a host where prefill produces KV more
slowly than the link carries it, every link converged to that rate.

The first transfer between two workers also pays for their connection (UCX endpoint, remote
keys, on a GPU the CUDA IPC mapping of the peer's pool: a one-time cost many times the copy's),
so it too counts only as a lower bound (`Flow.first_contact`, set by the caller, which knows the
pair). Counted as a measurement, the router's own warm-up requests set a same-host GPU link to
a small fraction of its rate; a local run then always priced lower than a pair, so no transfer
ever ran to correct it (docs/faults.md, the slow-link row's first GPU run).

A paced link (launcher.paced's token bucket in the prefill worker) says more: its sender
reports the bytes and seconds the bucket itself held back (kvtransfer.base SENDER_PHASES,
phase ``link``), whose ratio is the link's rate whatever the compute did, so that is the
sample; a paced transfer the bucket never held back only shows that the link kept up (a lower
bound). Without it, on a GPU shared by the prefill and the decode worker, a transfer on a fast
paced link outlasted its prefill by its last layer's landing and ACK (over the slack), counted
as a measurement of a fraction of the link's rate, and the policy then sent FP8 over a link that
did not need it (docs/results.md, "KV precision chosen by the link", run 1).

A transfer that missed its deadline (`finish(missed_deadline_s=...)`) did not move its bytes in
that time: the link carried less than k x bytes / deadline (k: the peak flows it shared the link
with). That is an upper bound, evidence of a slow link: it lowers the estimate to the bound at
once (never raises it), so the policy stops choosing the link without waiting for a transfer on
it to succeed; later transfers that do succeed raise it again through the EWMA.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pdserve.router.placement.topology import Link


@dataclass(frozen=True)
class LinkState:
    bytes_in_flight: int = 0
    active_flows: int = 0
    measured_gbps: float | None = None  # EWMA of the achieved link throughput; None before a sample
    num_samples: int = 0


IDLE = LinkState()


@dataclass(frozen=True)
class CongestionView:
    links: Mapping[str, LinkState] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))

    def state(self, key: str) -> LinkState:
        return self.links.get(key, IDLE)

    def __deepcopy__(self, memo: dict) -> CongestionView:
        return self  # immutable (a copy would lose what it records it follows)

    @classmethod
    def following(cls, links: dict[str, LinkState], previous: CongestionView | None,
                  changed: tuple[str, ...]) -> CongestionView:
        """A view that takes `links` as it is (no copy: the caller gives it up) and records that
        it is `previous` with the links `changed` in another state (LinkMonitor.view), so that a
        reader that followed `previous` reads only those (`changes_since`)."""
        view = cls.__new__(cls)
        object.__setattr__(view, "links", MappingProxyType(links))
        object.__setattr__(view, "_previous", None if previous is None else weakref.ref(previous))
        object.__setattr__(view, "_changed", changed)
        return view

    def changes_since(self, view: CongestionView | None) -> tuple[str, ...] | None:
        """The links whose state may differ from `view`'s, when this view knows; None otherwise."""
        if view is self:
            return ()
        previous = self.__dict__.get("_previous")
        if previous is not None and view is not None and previous() is view:
            return self.__dict__["_changed"]
        return None


def usable_gbps(link: Link, state: LinkState) -> float:
    """What the link carries in all: its capacity, or less when transfers measured less."""
    if state.measured_gbps is None:
        return link.capacity_gbps
    return min(link.capacity_gbps, state.measured_gbps)


def available_gbps(link: Link, state: LinkState) -> float:
    """The fair share a new flow gets (module docstring)."""
    return usable_gbps(link, state) / (state.active_flows + 1)


def transfer_seconds(link: Link, state: LinkState, num_bytes: int) -> float:
    """Predicted time for a new flow of `num_bytes`: base latency + bytes at the fair share."""
    if num_bytes <= 0:
        return 0.0
    return link.latency_ms / 1e3 + num_bytes * 8 / (available_gbps(link, state) * 1e9)


@dataclass
class Flow:
    """One transfer the router started; `peak_flows` counts itself. `first_contact`: the first
    transfer between its two workers (it pays for their connection: module docstring)."""

    key: str
    num_bytes: int
    peak_flows: int = 1
    done: bool = False
    first_contact: bool = False
    pair: tuple[str, str] | None = None  # (prefill, decode) worker ids, where the caller knows them


@dataclass
class _Link:
    flows: list[Flow] = field(default_factory=list)
    measured_gbps: float | None = None
    num_samples: int = 0


class LinkMonitor:
    """The router's mutable record of flows and measurements (module docstring)."""

    def __init__(self, *, alpha: float = 0.3, compute_slack: float = 0.25) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if isinstance(compute_slack, bool) or not isinstance(compute_slack, (int, float)) or not compute_slack >= 0:
            raise ValueError(f"compute_slack must be a number >= 0, got {compute_slack!r}")
        self.alpha = float(alpha)
        self.compute_slack = float(compute_slack)
        self._links: dict[str, _Link] = {}
        self._states: dict[str, LinkState] = {}  # state() of each link, until it changes
        self._current: dict[str, LinkState] = {}  # every link's state as of the last view
        self._dirty: dict[str, None] = {}  # links changed since the last view, in order
        self._view: CongestionView | None = None  # the last view

    def _changed(self, key: str) -> None:
        self._states.pop(key, None)
        self._dirty[key] = None

    def start(self, key: str, num_bytes: int) -> Flow:
        self._changed(key)
        link = self._links.setdefault(key, _Link())
        flow = Flow(key, max(0, int(num_bytes)))
        link.flows.append(flow)
        for other in link.flows:
            other.peak_flows = max(other.peak_flows, len(link.flows))
        return flow

    def finish(
        self, flow: Flow, *, kv_bytes: int = 0, kv_seconds: float = 0.0, prefill_seconds: float | None = None,
        missed_deadline_s: float | None = None, link_bytes: int = 0, link_seconds: float | None = None,
    ) -> float | None:
        """Ends `flow` (idempotent); with kv_bytes and kv_seconds > 0, records a sample and
        returns the link throughput it implies (Gbit/s). `missed_deadline_s`: the transfer missed
        that deadline: its bytes over it are an upper bound on the link (module docstring).
        `link_seconds` (a paced link's sender reports it, with `link_bytes`: the time and bytes
        the link itself held back): their ratio is the link's rate, a measurement; a paced
        transfer the link never held back is a lower bound (module docstring)."""
        if flow.done:
            return None
        flow.done = True
        self._changed(flow.key)
        link = self._links[flow.key]
        link.flows.remove(flow)
        if missed_deadline_s is not None and missed_deadline_s > 0 and flow.num_bytes > 0:
            bound = flow.num_bytes * 8 / missed_deadline_s / 1e9 * flow.peak_flows
            self.record(flow.key, bound, upper_bound=True)
            return bound
        if kv_bytes <= 0 or kv_seconds <= 0:
            return None
        if link_seconds is not None and link_bytes > 0 and link_seconds > 0 and not flow.first_contact:
            gbps = link_bytes * 8 / link_seconds / 1e9  # the paced link's own rate
            self.record(flow.key, gbps)
            return gbps
        gbps = kv_bytes * 8 / kv_seconds / 1e9 * flow.peak_flows
        lower_bound = flow.first_contact or link_seconds is not None or (
            prefill_seconds is not None and kv_seconds <= (1 + self.compute_slack) * prefill_seconds)
        self.record(flow.key, gbps, lower_bound=lower_bound)
        return gbps

    def record(self, key: str, gbps: float, *, lower_bound: bool = False, upper_bound: bool = False) -> None:
        """One throughput sample for link `key` (see the module docstring for `lower_bound` and
        `upper_bound`)."""
        if not gbps > 0:
            return
        if lower_bound and upper_bound:
            raise ValueError("a sample is a lower bound, an upper bound or a measurement, not both bounds")
        self._changed(key)
        link = self._links.setdefault(key, _Link())
        if upper_bound:
            if link.measured_gbps is not None and gbps >= link.measured_gbps:
                return
            link.measured_gbps = gbps
        elif link.measured_gbps is None:
            if lower_bound:
                return
            link.measured_gbps = gbps
        elif lower_bound and gbps <= link.measured_gbps:
            return
        else:
            link.measured_gbps = self.alpha * gbps + (1 - self.alpha) * link.measured_gbps
        link.num_samples += 1

    def state(self, key: str) -> LinkState:
        found = self._states.get(key)
        if found is not None:
            return found
        link = self._links.get(key)
        if link is None:
            return IDLE
        found = self._states[key] = LinkState(
            bytes_in_flight=sum(f.num_bytes for f in link.flows), active_flows=len(link.flows),
            measured_gbps=link.measured_gbps, num_samples=link.num_samples,
        )
        return found

    def keys(self) -> tuple[str, ...]:
        return tuple(self._links)

    def view(self) -> CongestionView:
        """Every link's state now. A router builds one a request, over every link it has used,
        so only the links changed since the last view are read again: an unchanged link keeps
        its LinkState object, an unchanged monitor its view, and each view records the last one
        and what changed since (CongestionView.changes_since)."""
        if self._dirty or self._view is None:
            for key in self._dirty:
                self._current[key] = self.state(key)
            changed, self._dirty = tuple(self._dirty), {}
            self._view = CongestionView.following(dict(self._current), self._view, changed)
        return self._view
