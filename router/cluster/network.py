"""The cluster backend's view of the network: topology, link flows and measurements, probes.

`NetworkTracker` is what `ClusterBackend` keeps (router.cluster.backend):
1. `start_flow` as a Prefill begins: a flow of prompt tokens x KV bytes per token on the link
   from P's node to D's node (router.placement.topology names it "src->dst");
2. `finish_flow` when the Prefill returns or fails: the flow ends; a finished transfer's
   kv_bytes / kv_seconds is a throughput sample for the link (router.placement.congestion) and
   kv_bytes / prompt tokens is the KV bytes per token from then on (the first transfer of a
   P->D worker pair, which pays for their connection, is only a lower bound; a failed transfer
   makes the pair's next one a first contact again); a transfer that missed its
   deadline bounds the link's rate from above (its bytes over the deadline);
3. per-link gauges (`pdserve:link_*`) follow every change;
4. probes (router.cluster.probes), when `ProbeSettings.interval_s` is set: one round at `start` and one
   every interval, one pair per link, one probe at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field, replace

from router.placement.congestion import Flow, LinkMonitor, usable_gbps
from router.errors import WorkerError
from router.metrics import RouterMetrics
from router.placement.base import PlacementPolicy
from router.cluster.probes import ProbeSettings, pairs_per_link, probe_pair
from router.placement.topology import Topology, link_key
from router.cluster.worker_client import PrefillResult
from router.cluster.worker_pool import PooledWorker, WorkerPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NetworkOptions:
    """`topology`: None takes the policy's (`policy.topology`), else the defaults.
    `kv_bytes_per_token`: a prior (ModelConfig.kv_bytes_per_token(dtype bytes)) until a transfer
    reports its bytes; 0 takes the policy's profile's when it has one (network-aware)."""

    topology: Topology | None = None
    kv_bytes_per_token: int = 0
    ewma_alpha: float = 0.3
    probes: ProbeSettings = field(default_factory=ProbeSettings)

    def __post_init__(self) -> None:
        if isinstance(self.kv_bytes_per_token, bool) or not isinstance(self.kv_bytes_per_token, int) \
                or self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be an integer >= 0, got {self.kv_bytes_per_token!r}")


class NetworkTracker:
    def __init__(
        self, options: NetworkOptions, pool: WorkerPool, policy: PlacementPolicy, metrics: RouterMetrics | None,
        *, rpc_timeout_s: float, max_model_len: int,
    ) -> None:
        self.options = options
        self.pool = pool
        self.metrics = metrics
        self.rpc_timeout_s = rpc_timeout_s
        self.max_model_len = max_model_len
        self.topology = options.topology or policy.topology or Topology()
        self.links = LinkMonitor(alpha=options.ewma_alpha)
        profile = getattr(policy, "profile", None)  # network-aware carries its measured profile
        self.kv_bytes_per_token: int = options.kv_bytes_per_token or getattr(profile, "kv_bytes_per_token", 0)
        self._num_probes = 0
        self._connected: set[tuple[str, str]] = set()  # P->D worker pairs that completed a transfer
        self._probe_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.options.probes.interval_s is not None and self._probe_task is None:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="link-probes")

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            self._probe_task = None

    # ---------------------------------------------------------------- flows

    def link_of(self, src: PooledWorker, dst: PooledWorker) -> str:
        t = self.topology
        return link_key(t.node_of(src.worker_id, src.endpoint.node), t.node_of(dst.worker_id, dst.endpoint.node))

    def start_flow(self, prefill: PooledWorker, decode: PooledWorker, num_tokens: int) -> Flow:
        flow = self.links.start(self.link_of(prefill, decode), num_tokens * self.kv_bytes_per_token)
        flow.pair = (prefill.worker_id, decode.worker_id)
        flow.first_contact = flow.pair not in self._connected
        self._export(flow.key)
        return flow

    def finish_flow(self, flow: Flow, result: PrefillResult | None, num_tokens: int,
                    missed_deadline_s: float | None = None) -> None:
        """`missed_deadline_s`: the Prefill failed because its KV missed that deadline (evidence
        that the link is slow: router.placement.congestion)."""
        pair = flow.pair
        if result is None:
            self._connected.discard(pair)  # a peer that failed may come back as a new process
            self.links.finish(flow, missed_deadline_s=missed_deadline_s)
        else:
            if pair is not None and result.kv_bytes:
                self._connected.add(pair)
            self.links.finish(flow, kv_bytes=result.kv_bytes, kv_seconds=result.kv_seconds,
                              prefill_seconds=result.prefill_seconds)
            if result.kv_bytes and num_tokens:  # at full precision, whatever the wire carried
                self.kv_bytes_per_token = round((result.kv_bytes + result.kv_bytes_saved) / num_tokens)
        self._export(flow.key)

    def _export(self, key: str) -> None:
        if self.metrics is None:
            return
        state = self.links.state(key)
        src, dst = key.split("->", 1)
        self.metrics.link_bytes_in_flight.labels(key).set(state.bytes_in_flight)
        self.metrics.link_active_flows.labels(key).set(state.active_flows)
        self.metrics.link_estimated_gbps.labels(key).set(usable_gbps(self.topology.link(src, dst), state))

    # ---------------------------------------------------------------- probes

    async def probe_links(self) -> dict[str, float | None]:
        """One probe per link between healthy prefill and decode workers, one after the other;
        link key -> the Gbit/s its transfer achieved (None: it failed)."""
        settings = self.options.probes
        if settings.num_tokens + 1 > self.max_model_len:
            settings = replace(settings, num_tokens=max(1, self.max_model_len - 1))
        got: dict[str, float | None] = {}
        for key, (prefill, decode) in pairs_per_link(list(self.pool.workers.values()), self.link_of).items():
            self._num_probes += 1
            flows: list[Flow] = []
            result: PrefillResult | None = None

            def on_start(p: PooledWorker = prefill, d: PooledWorker = decode) -> None:
                flows.append(self.start_flow(p, d, settings.num_tokens))

            try:
                result = await probe_pair(prefill, decode, f"probe-{self._num_probes}", settings,
                                          self.rpc_timeout_s, on_start=on_start)
            except WorkerError as exc:
                logger.info("link probe %s (%s -> %s) failed: %s", key, prefill.worker_id, decode.worker_id, exc)
            finally:
                for flow in flows:
                    self.finish_flow(flow, result, settings.num_tokens)
            ok = result is not None and result.kv_seconds > 0
            got[key] = result.kv_bytes * 8 / result.kv_seconds / 1e9 if ok else None  # type: ignore[union-attr]
        return got

    async def _probe_loop(self) -> None:
        interval = self.options.probes.interval_s
        assert interval is not None
        while True:
            try:
                await self.probe_links()
            except Exception:
                logger.exception("link probe round failed")
            await asyncio.sleep(interval)
