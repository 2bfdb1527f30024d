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
   every interval, one pair per link, one probe at a time;
5. re-probes (`NetworkOptions.reprobe_after_s`, for a policy that prices links by their estimates,
   network-aware): a link whose estimate is under its capacity and that no transfer has crossed
   for that long gets one probe, the stalest such link first, one every half of that time.
   An estimate that makes the policy avoid a link is otherwise corrected only by a transfer over
   it, which the policy then never sends: one slow transfer (a first use, a burst of other
   traffic) would keep a healthy link out for good. A link that is still slow costs the probe's
   deadline (its reservation is freed), not a user's request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field, replace

from pdserve.router.placement.congestion import Flow, LinkMonitor, usable_gbps
from pdserve.router.errors import WorkerError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement.base import PlacementPolicy
from pdserve.router.cluster.probes import ProbeSettings, pairs_per_link, probe_pair
from pdserve.router.placement.topology import Topology, link_key
from pdserve.router.cluster.worker_client import PrefillResult
from pdserve.router.cluster.worker_pool import PooledWorker, WorkerPool

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
    reprobe_after_s: float | None = 60.0  # module docstring, 5; None: never

    def __post_init__(self) -> None:
        if self.reprobe_after_s is not None and (
                isinstance(self.reprobe_after_s, bool) or not isinstance(self.reprobe_after_s, (int, float))
                or not math.isfinite(self.reprobe_after_s) or self.reprobe_after_s <= 0):
            raise ValueError(f"reprobe_after_s must be > 0 seconds or None, got {self.reprobe_after_s!r}")
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
        self.policy = policy
        self.topology = options.topology or policy.topology or Topology()
        self.links = LinkMonitor(alpha=options.ewma_alpha)
        profile = getattr(policy, "profile", None)  # network-aware carries its measured profile
        self.kv_bytes_per_token: int = options.kv_bytes_per_token or getattr(profile, "kv_bytes_per_token", 0)
        self._num_probes = 0
        self._connected: set[tuple[str, str]] = set()  # P->D worker pairs that completed a transfer
        self._last_flow: dict[str, float] = {}  # link key -> when a flow over it last ended (monotonic)
        self._probe_task: asyncio.Task[None] | None = None
        self._reprobe_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.options.probes.interval_s is not None and self._probe_task is None:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="link-probes")
        if (self.options.reprobe_after_s is not None and self.policy.uses_link_estimates
                and self._reprobe_task is None):
            self._reprobe_task = asyncio.create_task(self._reprobe_loop(), name="link-reprobes")

    async def close(self) -> None:
        for name in ("_probe_task", "_reprobe_task"):
            task = getattr(self, name)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                setattr(self, name, None)

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
        self._last_flow[flow.key] = time.monotonic()
        pair = flow.pair
        if result is None:
            self._connected.discard(pair)  # a peer that failed may come back as a new process
            self.links.finish(flow, missed_deadline_s=missed_deadline_s)
        else:
            if pair is not None and result.kv_bytes:
                self._connected.add(pair)
            self.links.finish(flow, kv_bytes=result.kv_bytes, kv_seconds=result.kv_seconds,
                              prefill_seconds=result.prefill_seconds, link_bytes=getattr(result, "kv_link_bytes", 0),
                              link_seconds=(result.kv_phases or {}).get("link"))
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

    def _probe_settings(self) -> ProbeSettings:
        settings = self.options.probes
        if settings.num_tokens + 1 > self.max_model_len:
            settings = replace(settings, num_tokens=max(1, self.max_model_len - 1))
        return settings

    async def _probe(self, key: str, prefill: PooledWorker, decode: PooledWorker) -> float | None:
        """One probe over `key` through the pair; the Gbit/s its transfer achieved (None: it failed)."""
        settings = self._probe_settings()
        self._num_probes += 1
        flows: list[Flow] = []
        result: PrefillResult | None = None

        def on_start() -> None:
            flows.append(self.start_flow(prefill, decode, settings.num_tokens))

        try:
            result = await probe_pair(prefill, decode, f"probe-{self._num_probes}", settings,
                                      self.rpc_timeout_s, on_start=on_start)
        except WorkerError as exc:
            logger.info("link probe %s (%s -> %s) failed: %s", key, prefill.worker_id, decode.worker_id, exc)
        finally:
            for flow in flows:
                self.finish_flow(flow, result, settings.num_tokens)
        ok = result is not None and result.kv_seconds > 0
        return result.kv_bytes * 8 / result.kv_seconds / 1e9 if ok else None  # type: ignore[union-attr]

    async def probe_links(self) -> dict[str, float | None]:
        """One probe per link between healthy prefill and decode workers, one after the other;
        link key -> the Gbit/s its transfer achieved (None: it failed)."""
        got: dict[str, float | None] = {}
        for key, (prefill, decode) in pairs_per_link(list(self.pool.workers.values()), self.link_of).items():
            got[key] = await self._probe(key, prefill, decode)
        return got

    def stale_links(self, now: float) -> list[str]:
        """Links a re-probe is due on (module docstring, 5), the stalest first: measured under
        their capacity, nothing in flight, no flow ended for `reprobe_after_s`."""
        after = self.options.reprobe_after_s
        if after is None:
            return []
        due = []
        for key, last in self._last_flow.items():
            state = self.links.state(key)
            src, dst = key.split("->", 1)
            if (state.measured_gbps is not None and state.active_flows == 0 and now - last >= after
                    and state.measured_gbps < self.topology.link(src, dst).capacity_gbps):
                due.append((last, key))
        return [key for _, key in sorted(due)]

    async def reprobe_stale(self, now: float | None = None) -> tuple[str, float | None] | None:
        """Probes the stalest link that is due (if a healthy pair crosses it); (key, Gbit/s or
        None) or None when none was probed."""
        now = time.monotonic() if now is None else now
        pairs = pairs_per_link(list(self.pool.workers.values()), self.link_of)
        for key in self.stale_links(now):
            if key in pairs:
                prefill, decode = pairs[key]
                logger.info("re-probing link %s (%s -> %s): estimate %.3g Gbit/s, no transfer for %.0f s",
                            key, prefill.worker_id, decode.worker_id, self.links.state(key).measured_gbps or 0.0,
                            now - self._last_flow[key])
                return key, await self._probe(key, prefill, decode)
        return None

    async def _reprobe_loop(self) -> None:
        after = self.options.reprobe_after_s
        assert after is not None
        while True:
            await asyncio.sleep(after / 2)
            try:
                await self.reprobe_stale()
            except Exception:
                logger.exception("link re-probe failed")

    async def _probe_loop(self) -> None:
        interval = self.options.probes.interval_s
        assert interval is not None
        while True:
            try:
                await self.probe_links()
            except Exception:
                logger.exception("link probe round failed")
            await asyncio.sleep(interval)
