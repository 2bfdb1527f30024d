"""Achieved KV transfer rate over UCX between two namespaces, link shaped by tc (HTB).

A transfer of ~1 s of data at the set rate, three times after a warm-up. Each test
creates and removes its own two namespaces. HTB caps the
rate; what a busy 2-core host takes away (other processes on the same cores) only lowers
it, so the best of three is the link's rate and every transfer must stay under the cap.
"""

import subprocess

import pytest

from pdserve.launcher.emulation import EmulatedCluster, LinkSpec
from pdserve.launcher.emulation.kvprobe import measure, transfer_mb
from tests.emulation.conftest import needs_netns

pytestmark = needs_netns


def _probe(run_id: str, link: LinkSpec, mb: float, transfers: int = 3) -> dict:
    with EmulatedCluster(["a", "b"], {("a", "b"): link}, run_id=run_id) as cluster:
        def spawn(side, argv):
            return cluster.run_in("b" if side == "recv" else "a", argv, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        return measure(spawn, cluster.ip("b"), mb, transfers, timeout_s=60)


@pytest.mark.parametrize("gbps", [1.0, 5.0])
def test_shaped_kv_rate_within_10_percent(run_id, gbps):
    if gbps > 1:
        ceiling = max(_probe(run_id, LinkSpec(), 300, transfers=2)["send_gbps"])
        # shaping costs CPU too (qdisc, timers, TCP pacing): on a 2-core host a shaped link
        # holds its rate only with clear headroom under the unshaped ceiling
        if ceiling < 1.5 * gbps:
            pytest.skip(f"this host carries only {ceiling:.2f} Gbit/s of UCX unshaped right now "
                        f"(CPU-bound, < 1.5x {gbps:g}); {gbps:g} Gbit/s cannot be held to 10% here")
    result = _probe(run_id, LinkSpec(gbps), transfer_mb(gbps, 1.0))
    rates = result["send_gbps"]
    assert max(rates) <= 1.10 * gbps, f"shaping let through {rates} at {gbps} Gbit/s"
    assert max(rates) >= 0.90 * gbps, f"achieved {rates} at {gbps} Gbit/s"
