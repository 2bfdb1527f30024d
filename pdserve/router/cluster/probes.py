"""Active link probes: a small synthetic disaggregated request over a P->D pair.

The router cannot push KV itself, so a probe is a real request that moves real KV: D.Reserve
for `num_tokens` tokens, P.Prefill with max_tokens=1 (P pushes the KV layer by layer and
reports kv_bytes / kv_seconds), then D.Abort frees the reservation, since the first token
already finishes it. One pair per link (src node -> dst node) is enough: every pair on a link
shares it. The cluster backend accounts the probe's flow like any other transfer and feeds the
sample to the link estimate.

Probes are off unless `ProbeSettings.interval_s` is set: then one round at start and one every
interval. A probe prompt repeats one token, so after the first round P's prefix cache holds it
and a probe costs P almost no compute (the KV still moves in full).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.sampling_params import SamplingParams
from pdserve.router.cluster.worker_client import PrefillResult
from pdserve.router.cluster.worker_pool import PooledWorker

PROBE_TOKEN_ID = 0


@dataclass(frozen=True)
class ProbeSettings:
    interval_s: float | None = None  # None: no probes
    num_tokens: int = 256
    deadline_s: float = 5.0

    def __post_init__(self) -> None:
        if self.interval_s is not None and (not isinstance(self.interval_s, (int, float))
                                            or not math.isfinite(self.interval_s) or self.interval_s <= 0):
            raise ValueError(f"probe interval_s must be > 0 seconds or None, got {self.interval_s!r}")
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"probe num_tokens must be an integer >= 1, got {self.num_tokens!r}")
        if not isinstance(self.deadline_s, (int, float)) or self.deadline_s <= 0:
            raise ValueError(f"probe deadline_s must be > 0, got {self.deadline_s!r}")


def pairs_per_link(
    workers: Sequence[PooledWorker], link_of: Callable[[PooledWorker, PooledWorker], str],
) -> dict[str, tuple[PooledWorker, PooledWorker]]:
    """Link key -> the first healthy (prefill, decode) pair over it, in worker-id order."""
    ordered = sorted(workers, key=lambda w: w.worker_id)
    prefills = [w for w in ordered if w.healthy and w.endpoint.role == "prefill"]
    decodes = [w for w in ordered if w.healthy and w.endpoint.role == "decode"]
    pairs: dict[str, tuple[PooledWorker, PooledWorker]] = {}
    for p in prefills:
        for d in decodes:
            pairs.setdefault(link_of(p, d), (p, d))
    return pairs


async def probe_pair(
    prefill: PooledWorker, decode: PooledWorker, wire_id: str, settings: ProbeSettings, rpc_timeout_s: float,
    on_start: Callable[[], object] = lambda: None,
) -> PrefillResult:
    """Runs one probe; `on_start` is called as the Prefill (the transfer) begins. Raises the
    worker client's WorkerError on failure; D's reservation is always freed."""
    prompt = [PROBE_TOKEN_ID] * settings.num_tokens
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        reservation = await decode.client.reserve(wire_id, prompt, params, settings.deadline_s)
        on_start()
        return await prefill.client.prefill(
            wire_id, prompt, params, reservation, settings.deadline_s, timeout_s=settings.deadline_s + rpc_timeout_s,
        )
    finally:
        try:
            await decode.client.abort(wire_id, timeout_s=rpc_timeout_s)
        except Exception:  # best effort: a dead D frees nothing anyway
            pass
