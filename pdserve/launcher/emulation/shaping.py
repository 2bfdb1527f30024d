"""`tc` shaping of a node's egress: one HTB class per destination node.

On the node's veth (inside its namespace)::

    htb 1: root, default 1:1
    ├── 1:1   unshaped (UNSHAPED_GBPS): the root namespace (gRPC), unlisted peers
    ├── 1:10  rate = link(node, peer 0), u32 filter: ip dst <peer 0>/32
    │         └── netem delay <latency_ms>   (only when the link has latency)
    └── 1:11  ...

Each class has rate = ceil (no borrowing), so a link never exceeds its rate, and links
out of one node do not share a budget (a node with two 10 Gbit links may send 20). HTB
counts every byte of each packet including IP/TCP headers (GSO segments included), so
the payload rate is the set rate less ~0.1% at MTU 65535. ``burst`` is ``BURST_S`` at
the link rate (at least two packets): the HTB default (a few packets' worth) keeps a class
of a few Gbit/s well under its rate on a busy small host (docs/results.md, "Figures behind
the code's choices").
"""

from __future__ import annotations

import math
from typing import Sequence

from pdserve.launcher.emulation.errors import EmulationError
from pdserve.launcher.emulation.commands import NODE_DEVICE, ip_cmd, tc_cmd
from pdserve.launcher.emulation.link import LinkSpec

UNSHAPED_GBPS = 1000.0  # the default class: effectively unlimited on a veth
_QUANTUM = 65536  # bytes a class may send per round; >= MTU, quiets HTB's "quantum is big"
_FIRST_MINOR = 0x10


def _bits(gbps: float) -> str:
    return f"{int(round(gbps * 1e9))}bit"


BURST_S = 100e-6


def burst_bytes(gbps: float, mtu: int) -> int:
    return max(32 * 1024, 2 * mtu, int(gbps * 1e9 / 8 * BURST_S))


def netem_limit(gbps: float | None, latency_ms: float, mtu: int) -> int:
    """Packets netem must hold: the bandwidth-delay product, x4 for slack."""
    rate = (gbps or UNSHAPED_GBPS) * 1e9 / 8
    return max(1000, math.ceil(rate * latency_ms / 1e3 / mtu * 4))


def shape_node(netns: str, device: str, peers: Sequence[tuple[str, LinkSpec]], mtu: int = 1500) -> None:
    """Install the HTB tree on ``device`` in ``netns``; ``peers``: (destination address,
    link) for each shaped link. Replaces whatever root qdisc was there."""
    if len(peers) > 0xFFFF - _FIRST_MINOR:
        raise EmulationError(f"too many shaped links out of {netns}: {len(peers)}")
    tc_cmd("qdisc", "replace", "dev", device, "root", "handle", "1:", "htb", "default", "1", netns=netns)
    _add_class(netns, device, "1:1", UNSHAPED_GBPS, mtu)
    for i, (address, link) in enumerate(peers):
        minor = f"{_FIRST_MINOR + i:x}"
        gbps = link.gbps if link.gbps is not None else UNSHAPED_GBPS
        _add_class(netns, device, f"1:{minor}", gbps, mtu)
        if link.latency_ms > 0:
            _add_delay(netns, device, minor, link, mtu)
        tc_cmd("filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "ip", "dst", f"{address}/32", "flowid", f"1:{minor}", netns=netns)


def _add_delay(netns: str, device: str, minor: str, link: LinkSpec, mtu: int) -> None:
    try:
        tc_cmd("qdisc", "add", "dev", device, "parent", f"1:{minor}", "handle", f"{minor}:", "netem",
               "delay", f"{link.latency_ms}ms", "limit", str(netem_limit(link.gbps, link.latency_ms, mtu)),
               netns=netns)
    except EmulationError as e:
        if "unknown" in str(e).lower():
            raise EmulationError(
                f"a link with latency_ms={link.latency_ms:g} needs tc's netem, which this kernel lacks "
                "(module sch_netem); set latency_ms: 0 here or run on a kernel with netem") from None
        raise


def _add_class(netns: str, device: str, classid: str, gbps: float, mtu: int) -> None:
    rate, burst = _bits(gbps), str(burst_bytes(gbps, mtu))
    tc_cmd("class", "add", "dev", device, "parent", "1:", "classid", classid, "htb", "rate", rate, "ceil", rate,
           "burst", burst, "cburst", burst, "quantum", str(_QUANTUM), netns=netns)


def unshape_node(netns: str, device: str) -> None:
    """Remove the shaping of ``device`` (back to the kernel's default qdisc)."""
    tc_cmd("qdisc", "del", "dev", device, "root", netns=netns, check=False)


def qdiscs(netns: str | None, device: str | None = None) -> list[str]:
    """``tc qdisc show`` lines (of ``device``, in ``netns`` or the root namespace)."""
    args = ["qdisc", "show"] + (["dev", device] if device else [])
    return [line for line in tc_cmd(*args, netns=netns).stdout.splitlines() if line.strip()]


def class_rates(netns: str, device: str) -> dict[str, float]:
    """classid -> rate in Gbit/s of the HTB classes on ``device``."""
    out = {}
    for line in tc_cmd("class", "show", "dev", device, netns=netns).stdout.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[0] == "class" and parts[1] == "htb" and "rate" in parts:
            out[parts[2]] = parse_rate(parts[parts.index("rate") + 1])
    return out


_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(text: str) -> float:
    """``tc``'s printed rate (``5Gbit``, ``800Mbit``) -> Gbit/s."""
    low = text.lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if low.endswith(unit):
            return float(low[: -len(unit)]) * _UNITS[unit] / 1e9
    raise ValueError(f"cannot parse tc rate {text!r}")


# ---- faults: loss and delay on a link, for a while -------------------------------------------

NO_NETEM = ("tc netem is not available on this kernel (module sch_netem), so a link cannot get loss or "
            "delay here")


def netem_available() -> bool:
    """Whether this kernel has sch_netem (tried on the loopback of a throwaway namespace)."""
    import os

    ns = f"pds-netemprobe{os.getpid() % 100000}"
    try:
        ip_cmd("netns", "add", ns)
        return tc_cmd("qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", netns=ns,
                      check=False).returncode == 0
    except EmulationError:
        return False
    finally:
        ip_cmd("netns", "del", ns, check=False)


def _peer_minor(cluster, node: str, peer: str) -> str:
    """The HTB class minor (hex) of `node`'s shaped link to `peer` (the order of shape_node)."""
    shaped = [other for other in cluster.nodes if other != node and cluster.link(node, other).shaped]
    if peer not in shaped:
        raise EmulationError(f"the link {node}<->{peer} is not shaped, so it has no class to impair; "
                             "give it a rate (gbps) in the spec")
    return f"{_FIRST_MINOR + shaped.index(peer):x}"


def impair_link(cluster, a: str, b: str, loss_pct: float, delay_ms: float) -> None:
    """Adds `loss_pct` % packet loss and `delay_ms` of delay (netem) to both directions of the
    shaped link a<->b of a created `EmulatedCluster`, on top of its rate; `restore_link` undoes it."""
    if not (0 <= loss_pct <= 100) or delay_ms < 0:
        raise EmulationError(f"loss must be in [0, 100] % and delay >= 0 ms, got {loss_pct} %, {delay_ms} ms")

    link = cluster.link(a, b)
    for src, dst in ((a, b), (b, a)):
        minor = _peer_minor(cluster, src, dst)
        args = ["delay", f"{delay_ms + link.latency_ms:g}ms"] if delay_ms + link.latency_ms > 0 else []
        args += ["loss", f"{loss_pct:g}%"] if loss_pct > 0 else []
        limit = netem_limit(link.gbps, max(delay_ms + link.latency_ms, 1.0), cluster.mtu)
        try:
            tc_cmd("qdisc", "replace", "dev", NODE_DEVICE, "parent", f"1:{minor}", "handle", f"{minor}:", "netem",
                   *args, "limit", str(limit), netns=cluster.ns(src))
        except EmulationError as e:
            if "unknown" in str(e).lower():
                raise EmulationError(NO_NETEM) from None
            raise


def restore_link(cluster, a: str, b: str) -> None:
    """Back to the link as the spec gave it (its own latency, no loss)."""

    link = cluster.link(a, b)
    for src, dst in ((a, b), (b, a)):
        minor = _peer_minor(cluster, src, dst)
        if link.latency_ms > 0:
            netem = ["delay", f"{link.latency_ms:g}ms", "limit",
                               str(netem_limit(link.gbps, link.latency_ms, cluster.mtu))]
            tc_cmd("qdisc", "replace", "dev", NODE_DEVICE, "parent", f"1:{minor}", "handle", f"{minor}:", "netem",
                   *netem, netns=cluster.ns(src))
        else:
            tc_cmd("qdisc", "del", "dev", NODE_DEVICE, "parent", f"1:{minor}", netns=cluster.ns(src), check=False)
