"""Link emulation: hold the KV links of an emulated multi-node cluster at 1-100 Gbit/s.

Two methods (docs/design.md, "Link emulation"):

- ``tc`` (real shaping): one network namespace per emulated node, joined by veths to a
  bridge, each node-pair link shaped by HTB (+ netem for latency) on the node's egress.
  UCX crosses the links over TCP (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=pds0``).
- ``pacing``: a token bucket per link inside kvtransfer (``LinkPacer``), for transports
  that bypass the kernel; ``pdserve.kvtransfer.pacing_spec`` parses the per-destination pacing
  option (a worker's ``--kv-pacing``).

Modules: ``netns`` (namespaces, veths, ``EmulatedCluster``, ``cleanup``), ``shaping``
(tc), ``spec`` (topology YAML), ``cluster``
(workers and router inside the emulated cluster), ``kvprobe`` (KV transfer rate
probe between namespaces), ``__main__`` (``python -m pdserve.launcher.emulation``).
"""

from pdserve.launcher.emulation.errors import EmulationError, EmulationSpecError
from pdserve.launcher.emulation.netns import (EmulatedCluster, LinkSpec, cleanup, list_links, list_namespaces,
                                             netns_permitted)

__all__ = [
    "EmulatedCluster",
    "EmulationError",
    "EmulationSpecError",
    "LinkSpec",
    "cleanup",
    "list_links",
    "list_namespaces",
    "netns_permitted",
]
