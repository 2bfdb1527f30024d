"""Crafted profiles, topologies and snapshots for the network-aware tests (exact numbers).

PROFILE: prefill takes 0.1 ms per token (a line through the measured points), a decode step
0.01 s plus 0.04/63 s per request beyond the first; KV is 128 KiB per token (Llama-3.1-8B in
bf16), 32 layers. A 4096-token prompt: 0.4096 s of prefill, 512 MiB of KV (4.29 s at 1 Gbps,
0.043 s at 100 Gbps).
"""

from __future__ import annotations

from pdserve.router.placement.congestion import CongestionView, LinkState
from pdserve.router.placement.base import ClusterSnapshot, RequestInfo, WorkerSnapshot
from pdserve.router.placement.profiles import Profile
from pdserve.router.placement.topology import Link, Topology

PROFILE = Profile(
    hardware="test GPU", device="cuda", model="random:llama-3.1-8b", dtype="bfloat16", num_layers=32,
    kv_bytes_per_token=128 * 1024, block_size=16, max_num_batched_tokens=512,
    prefill_tokens=(16, 4096), prefill_times=(0.0016, 0.4096),
    decode_batch_sizes=(1, 64), decode_contexts=(128, 8192), decode_times=((0.01, 0.01), (0.05, 0.05)),
)


def w(worker_id: str, role: str, node: str, **kw) -> WorkerSnapshot:
    return WorkerSnapshot(worker_id=worker_id, role=role, node=node, **kw)  # type: ignore[arg-type]


def req(num_prompt_tokens: int = 4096, max_tokens: int = 16, **kw) -> RequestInfo:
    return RequestInfo(request_id="r", num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens, **kw)


def topology(*links: tuple[str, str, float], remote_gbps: float = 10.0) -> Topology:
    """Directional links (src, dst, Gbit/s), 0 ms latency."""
    return Topology(links=tuple(Link(a, b, gbps, 0.0) for a, b, gbps in links), remote_gbps=remote_gbps,
                    remote_latency_ms=0.0, local_latency_ms=0.0)


def snapshot(workers: tuple[WorkerSnapshot, ...], topo: Topology, flows: dict[str, int] | None = None,
             **kw) -> ClusterSnapshot:
    links = CongestionView({key: LinkState(active_flows=n) for key, n in (flows or {}).items()})
    return ClusterSnapshot(workers, topology=topo, links=links, **kw)
