"""An emulated multi-node cluster on one Linux host: one network namespace per node.

Layout of one run (``<run>``: a short hex id, so that parallel runs and leftovers are told
apart; every name starts with ``pds-<run>-``)::

    root ns                 hub ns  pds-<run>-hub          node ns  pds-<run>-n<i>
    pds-<run>-rt ──veth──── rt ─┐                           ┌── pds0  10.a.b.(i+1)/24
    10.a.b.254/24               ├─ br0 (bridge) ─ n<i> ─veth┘   (+ lo, up)
                                └─ ...

- Every node has a single interface ``pds0`` into the hub's bridge, so every node reaches
  every other node and the root namespace on one /24 of 10.0.0.0/8 that no route of the host
  uses yet.
- Links are shaped on each node's egress (``pds0``): an HTB class per destination node,
  selected by destination address (``shaping.py``). A link (a, b) is held at its rate in
  each direction. Traffic to the root namespace (gRPC from the router, probes) falls into
  the default class and is not shaped: only the KV path between nodes is.
- Processes run inside a node through ``ip netns exec`` (``run_in``). UCX must then cross
  the veth: ``env(node)`` sets ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=pds0`` (and
  ``UCX_RNDV_THRESH=inf``, see ``UCX_ENV``). Shared memory and CMA (UCX's default between
  processes of one host) would bypass the link and its shaping altogether. Processes on
  the same node talk over ``lo``, unshaped.

Teardown (``destroy``, also from ``__exit__``, SIGINT/SIGTERM while inside ``with``, and
at interpreter exit) stops the processes it started, kills whatever else still runs in the
namespaces, and deletes the namespaces (with them their veths and qdiscs) and the root
veth. ``cleanup(prefix)`` does the same for leftovers of runs that died hard.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from typing import Iterable, Mapping, Sequence

from pdserve import environment
from pdserve.launcher.emulation.commands import NODE_DEVICE, ip_cmd, tc_cmd
from pdserve.launcher.emulation.errors import EmulationError
from pdserve.launcher.emulation.link import LinkSpec

__all__ = ["NODE_DEVICE", "EmulatedCluster", "LinkSpec", "cleanup", "ip_cmd", "list_links", "list_namespaces",
           "netns_permitted", "tc_cmd"]

logger = logging.getLogger(__name__)

PREFIX = "pds-"
_HUB_BRIDGE = "br0"
_MAX_IFNAME = 15  # IFNAMSIZ - 1
# Environment of processes inside a node. UCX_TLS/UCX_NET_DEVICES: TCP over the node's veth
# (shared memory / CMA would bypass the link). UCX_RNDV_THRESH=inf: eager sends; the
# rendezvous protocol pays a round trip per message through the shaped queue, which leaves a
# shaped link idle part of the time (docs/results.md, "Figures behind the code's choices").
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": NODE_DEVICE, "UCX_RNDV_THRESH": "inf"}
_RUN_ID = re.compile(r"^[a-z0-9]{1,8}$")


def netns_permitted() -> bool:
    """Whether this process may create network namespaces and veths (root, iproute2)."""
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        ok = ip_cmd("netns", "add", probe, check=False).returncode == 0
    except EmulationError:
        return False
    if ok:
        ip_cmd("netns", "delete", probe, check=False)
    return ok


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    out = ip_cmd("netns", "list").stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.strip() and line.startswith(prefix))


def list_links(prefix: str = PREFIX, netns: str | None = None) -> list[str]:
    """Interface names starting with ``prefix`` in the root namespace (or ``netns``)."""
    out = ip_cmd("-o", "link", "show", netns=netns).stdout
    names = [line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return sorted(n for n in names if n.startswith(prefix))


def namespace_pids(netns: str) -> list[int]:
    out = ip_cmd("netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(netns: str, grace_s: float = 5.0) -> None:
    """SIGTERM every process inside ``netns``, wait up to ``grace_s``, SIGKILL the rest."""
    pids = namespace_pids(netns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = namespace_pids(netns)
        if not pids:
            return
    logger.warning("processes %s in %s survived SIGKILL", pids, netns)


def cleanup(prefix: str = PREFIX, grace_s: float = 5.0) -> list[str]:
    """Remove every namespace and root-namespace interface whose name starts with
    ``prefix`` (default: leftovers of every run), killing the processes inside first.
    Returns what was removed. Node namespaces go before hubs, so no veth dangles."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"prefix must start with {PREFIX!r} (only emulation objects are removed), got {prefix!r}")
    removed = []
    namespaces = list_namespaces(prefix)
    for ns in sorted(namespaces, key=lambda n: n.endswith("-hub")):
        kill_namespace_processes(ns, grace_s)
        if ip_cmd("netns", "delete", ns, check=False).returncode == 0:
            removed.append(ns)
    for link in list_links(prefix):
        if ip_cmd("link", "delete", link, check=False).returncode == 0:
            removed.append(link)
    return removed


# ---------------------------------------------------------------------------------------
# topology


def _pair(key) -> tuple[str, str]:
    if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key)):
        raise ValueError(f"a link key must be a pair of node names, got {key!r}")
    if key[0] == key[1]:
        raise ValueError(f"a link needs two different nodes, got {key!r}")
    return tuple(sorted(key))  # type: ignore[return-value]


def _pick_subnet(run_id: str) -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0-10.249.255.0 derived from the run id that overlaps no route or
    address of the root namespace (so parallel runs and the host's networks stay apart)."""
    used = []
    for line in ip_cmd("-4", "-o", "route", "show", "table", "all").stdout.splitlines():
        token = line.split()[0] if line.split() else ""
        if token in ("local", "broadcast", "unreachable", "prohibit", "blackhole"):
            token = line.split()[1]
        with contextlib.suppress(ValueError):
            if token != "default":
                used.append(ipaddress.ip_network(token, strict=False))
    start = int.from_bytes(run_id.encode(), "little") % (50 * 256)
    for i in range(50 * 256):
        n = (start + i) % (50 * 256)
        net = ipaddress.ip_network(f"10.{200 + n // 256}.{n % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise EmulationError("no free /24 in 10.200.0.0/16-10.249.0.0/16 for the emulated cluster")


# signal handlers are process-wide: the innermost live cluster's restore the previous ones
_LIVE: list["EmulatedCluster"] = []
_LIVE_LOCK = threading.Lock()


def _destroy_live_at_exit() -> None:
    for cluster in list(reversed(_LIVE)):
        cluster.destroy()


atexit.register(_destroy_live_at_exit)


class Terminated(BaseException):
    """SIGTERM arrived inside an EmulatedCluster block; raised so that the block unwinds."""


class EmulatedCluster:
    """Namespaces, veths, bridge and shaping for ``nodes`` joined by ``links``.

    ``links``: ``{(a, b): LinkSpec}``, unordered pairs; pairs not listed are unshaped.
    ``run_id``: up to 8 of [a-z0-9] (default: random); every object is named
    ``pds-<run_id>-*``. ``mtu``: of every veth (default 65535, as ``lo``: per-packet CPU
    cost is what caps a veth on a small host, so the largest MTU carries the most; the unshaped
    rates by MTU: docs/results.md, "Figures behind the code's choices". The shaped rate is per
    byte either way, headers included: ~0.1% at 65535).
    ``handle_signals``: while inside ``with`` (main thread only), SIGTERM raises
    ``Terminated`` and SIGINT ``KeyboardInterrupt`` so the block unwinds and tears down;
    the previous handlers are restored on exit.

    Use as a context manager; ``create()`` / ``destroy()`` for manual control.
    """

    def __init__(
        self,
        nodes: Sequence[str],
        links: Mapping[tuple[str, str], LinkSpec] | None = None,
        run_id: str | None = None,
        mtu: int = 65535,
        handle_signals: bool = True,
    ):
        nodes = list(nodes)
        if not nodes:
            raise ValueError("an emulated cluster needs at least one node")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"node names must be distinct, got {nodes}")
        if len(nodes) > 250:
            raise ValueError(f"at most 250 nodes, got {len(nodes)}")
        self.run_id = run_id or secrets.token_hex(3)
        if not _RUN_ID.match(self.run_id):
            raise ValueError(f"run_id must be 1-8 of [a-z0-9], got {self.run_id!r}")
        if not 1280 <= mtu <= 65535:
            raise ValueError(f"mtu must be in [1280, 65535], got {mtu}")
        self.nodes = nodes
        self.links: dict[tuple[str, str], LinkSpec] = {}
        for key, spec in (links or {}).items():
            pair = _pair(key)
            for node in pair:
                if node not in nodes:
                    raise ValueError(f"link {key!r} names unknown node {node!r}; nodes: {nodes}")
            if pair in self.links:
                raise ValueError(f"link {pair!r} is given twice")
            if not isinstance(spec, LinkSpec):
                raise ValueError(f"link {key!r}: expected a LinkSpec, got {spec!r}")
            self.links[pair] = spec
        self.mtu = mtu
        self.prefix = f"{PREFIX}{self.run_id}-"
        self.hub = f"{self.prefix}hub"
        self.root_device = f"{self.prefix}rt"
        assert len(self.root_device) <= _MAX_IFNAME
        self.subnet: ipaddress.IPv4Network | None = None
        self._handle_signals = handle_signals
        self._saved_handlers: dict[int, object] = {}
        self._procs: list[tuple[subprocess.Popen, bool]] = []  # (process, leads its own session)
        self._created = False
        self._lock = threading.Lock()

    # ---- names and addresses -----------------------------------------------------------

    def ns(self, node: str) -> str:
        """The namespace of ``node``: ``pds-<run>-n<index>``."""
        return f"{self.prefix}n{self._index(node)}"

    def ip(self, node: str) -> str:
        """The address of ``node`` on the emulated network."""
        self._check_created()
        return str(self.subnet.network_address + self._index(node) + 1)

    @property
    def root_ip(self) -> str:
        """The root namespace's address on the emulated network (the router's side)."""
        self._check_created()
        return str(self.subnet.network_address + 254)

    def link(self, a: str, b: str) -> LinkSpec:
        return self.links.get(_pair((a, b)), LinkSpec())

    def env(self, node: str) -> dict[str, str]:
        """Environment for processes in ``node``: UCX over TCP on the node's veth only."""
        self._index(node)
        return dict(UCX_ENV)

    def _index(self, node: str) -> int:
        try:
            return self.nodes.index(node)
        except ValueError:
            raise ValueError(f"unknown node {node!r}; nodes: {self.nodes}") from None

    def _check_created(self) -> None:
        if not self._created:
            raise EmulationError("the emulated cluster is not created (use it in a with block)")

    # ---- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self._install_signals()
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        """Create namespaces, veths, bridge, addresses and shaping. On failure, whatever
        was created stays for ``destroy()`` (``__enter__`` calls it)."""
        from pdserve.launcher.emulation.shaping import shape_node

        with self._lock:
            if self._created:
                raise EmulationError("already created")
            if list_namespaces(self.prefix) or list_links(self.prefix):
                raise EmulationError(f"objects named {self.prefix}* exist already; "
                                     f"run `python -m pdserve.launcher.emulation cleanup --prefix {self.prefix}`")
            with _LIVE_LOCK:
                _LIVE.append(self)
            self.subnet = _pick_subnet(self.run_id)
            self._created = True
        plen = self.subnet.prefixlen
        mtu = str(self.mtu)
        ip_cmd("netns", "add", self.hub)
        ip_cmd("link", "set", "lo", "up", netns=self.hub)
        ip_cmd("link", "add", _HUB_BRIDGE, "type", "bridge", netns=self.hub)
        ip_cmd("link", "set", _HUB_BRIDGE, "mtu", mtu, "up", netns=self.hub)
        # root namespace: one veth into the hub, for the router and other control traffic
        ip_cmd("link", "add", self.root_device, "mtu", mtu, "type", "veth", "peer", "name", "rt", "mtu", mtu,
               "netns", self.hub)
        ip_cmd("link", "set", "rt", "master", _HUB_BRIDGE, "up", netns=self.hub)
        ip_cmd("addr", "add", f"{self.root_ip}/{plen}", "dev", self.root_device)
        ip_cmd("link", "set", self.root_device, "up")
        for i, node in enumerate(self.nodes):
            ns, port = self.ns(node), f"n{i}"
            ip_cmd("netns", "add", ns)
            ip_cmd("link", "set", "lo", "up", netns=ns)
            ip_cmd("link", "add", NODE_DEVICE, "mtu", mtu, "netns", ns, "type", "veth",
                   "peer", "name", port, "mtu", mtu, "netns", self.hub)
            ip_cmd("link", "set", port, "master", _HUB_BRIDGE, "up", netns=self.hub)
            ip_cmd("addr", "add", f"{self.ip(node)}/{plen}", "dev", NODE_DEVICE, netns=ns)
            ip_cmd("link", "set", NODE_DEVICE, "up", netns=ns)
        for node in self.nodes:
            peers = [(self.ip(other), self.link(node, other)) for other in self.nodes if other != node]
            shape_node(self.ns(node), NODE_DEVICE, [(ip, spec) for ip, spec in peers if spec.shaped], self.mtu)
        logger.info("emulated cluster %s: %s on %s", self.run_id,
                    ", ".join(f"{n}={self.ns(n)}@{self.ip(n)}" for n in self.nodes), self.subnet)

    def destroy(self, grace_s: float = 10.0) -> None:
        """Stop processes, delete every namespace and veth of this run. Idempotent; signals
        are held off meanwhile so that a second Ctrl-C cannot leave half a cluster."""
        blocked = threading.current_thread() is threading.main_thread()
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            with self._lock:
                procs, self._procs = self._procs, []
                for proc, own_session in procs:
                    _terminate(proc, own_session, grace_s)
                cleanup(self.prefix, grace_s=min(grace_s, 5.0))
                self._created = False
                with _LIVE_LOCK:
                    if self in _LIVE:
                        _LIVE.remove(self)
        finally:
            self._restore_signals()
            if blocked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    def _install_signals(self) -> None:
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return

        def on_term(signum, frame):
            raise Terminated(f"signal {signum}")

        def on_int(signum, frame):
            raise KeyboardInterrupt

        self._saved_handlers = {signal.SIGTERM: signal.signal(signal.SIGTERM, on_term),
                                signal.SIGINT: signal.signal(signal.SIGINT, on_int)}

    def _restore_signals(self) -> None:
        saved, self._saved_handlers = self._saved_handlers, {}
        if threading.current_thread() is threading.main_thread():
            for signum, handler in saved.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    # ---- processes ---------------------------------------------------------------------

    def run_in(self, node: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
               **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace (``ip netns exec``), with ``env(node)``
        and ``env`` over the current environment. The process gets its own session and is
        stopped by ``destroy()``. ``popen_kwargs`` go to ``subprocess.Popen``."""
        self._check_created()
        full_env = environment.child_env(self.env(node) | dict(env or {}))
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], env=full_env, **popen_kwargs)
        with self._lock:
            self._procs.append((proc, bool(popen_kwargs["start_new_session"])))
        return proc

    def describe(self) -> dict:
        """Names, addresses and links, for logs and reports."""
        self._check_created()
        return {
            "run_id": self.run_id,
            "subnet": str(self.subnet),
            "root": {"device": self.root_device, "ip": self.root_ip},
            "nodes": {n: {"netns": self.ns(n), "ip": self.ip(n), "device": NODE_DEVICE} for n in self.nodes},
            "links": [{"a": a, "b": b, "gbps": s.gbps, "latency_ms": s.latency_ms} for (a, b), s in self.links.items()],
        }


def _terminate(proc: subprocess.Popen, own_session: bool, grace_s: float) -> None:
    """SIGTERM the process (its whole session when it leads one), wait, then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if own_session:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def names_of(cluster: EmulatedCluster) -> Iterable[str]:
    """Every namespace and root interface name the cluster owns (for tests and logs)."""
    return [*(cluster.ns(n) for n in cluster.nodes), cluster.hub, cluster.root_device]
