"""Topology spec of an emulated cluster: YAML in (through yamlconfig, schema `EmulationFile`),
a frozen dataclass out; errors read ``file:line: field 'topology.links[0].gbps': problem``.
Unknown keys are rejected.

    name: str = file stem
    model: str                       # `pdserve worker --model` (and the router's tokenizer)
    method: tc | pacing = tc         # who holds the links (shaping.py / pacing_spec.py)
    worker_args: [str] = []          # extra `pdserve worker` flags, e.g. [--kv-cache-gib, "0.05"]
    workers:                         # at least one prefill and one decode
      - {id: p0, role: prefill | decode | mixed, node: <node>}
    topology:                        # the router's topology schema (pdserve/router/placement/topology.py)
      nodes: [str]                   # node names (letters, digits, . _ -)
      links:                         # node pairs (tc holds both directions); others take the default
        - {between: [<node>, <node>], gbps: number > 0, latency_ms: number >= 0 = remote_latency_ms}
      defaults: {remote_gbps, remote_latency_ms}   # without remote_gbps unlisted pairs are unshaped;
                                     # remote_latency_ms defaults to 0.1 as in the router
    router:
      port: int = 8000
      policy: str = round-robin
      args: [str] = []               # extra `pdserve router` flags, for every policy
      policy_args:                   # extra flags for one policy only (baselines reject
        network-aware: [--profile, p.json, --slo-ttft, "1.0"]   # --profile and --slo-*)
      log_level: WARNING             # the router's --log-level (DEBUG logs every placement)

``gbps`` is the SET rate of a link (what the router's topology gets); which rate the
transfers achieve is measured, see benchmarks/bench_links.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from pydantic import field_validator

from pdserve.loadgen import yamlconfig
from pdserve.launcher.emulation.errors import EmulationSpecError
from pdserve.launcher.emulation.link import LinkSpec
from pdserve.router.placement.topology import TopologyFile

METHODS = ("tc", "pacing")
ROLES = ("prefill", "decode", "mixed")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class WorkerSpec:
    id: str
    role: str
    node: str


@dataclass(frozen=True)
class RouterSpec:
    port: int = 8000
    policy: str = "round-robin"
    args: tuple[str, ...] = ()
    policy_args: dict = field(default_factory=dict)  # policy name -> tuple of flags
    log_level: str | None = None

    def args_for(self, policy: str) -> tuple[str, ...]:
        return (*self.args, *self.policy_args.get(policy, ()))


@dataclass(frozen=True)
class TopologySpec:
    name: str
    model: str
    nodes: tuple[str, ...]
    workers: tuple[WorkerSpec, ...]
    links: dict = field(default_factory=dict)  # (a, b) sorted -> LinkSpec
    default_link: LinkSpec | None = None
    method: str = "tc"
    worker_args: tuple[str, ...] = ()
    router: RouterSpec = RouterSpec()
    path: str = ""

    def link(self, a: str, b: str) -> LinkSpec:
        return self.links.get(tuple(sorted((a, b))), self.default_link or LinkSpec())

    def all_links(self) -> dict[tuple[str, str], LinkSpec]:
        """Every node pair with a shaped link (listed, or from default_link)."""
        out = {}
        for i, a in enumerate(self.nodes):
            for b in self.nodes[i + 1:]:
                spec = self.link(a, b)
                if spec.shaped:
                    out[(a, b)] = spec
        return out

    def with_rate(self, gbps: float) -> TopologySpec:
        """Every link (listed and default) at ``gbps``, latencies kept (``--link-gbps``)."""
        links = {k: replace(v, gbps=gbps) for k, v in self.links.items()}
        default = replace(self.default_link or LinkSpec(), gbps=gbps)
        return replace(self, links=links, default_link=default)


# ---------------------------------------------------------------- the file's schema

_Name = yamlconfig.name(_NAME.pattern)


class _WorkerEntry(yamlconfig.Schema):
    id: _Name
    role: Literal["prefill", "decode", "mixed"]
    node: yamlconfig.name()


class _RouterEntry(yamlconfig.Schema):
    port: yamlconfig.whole(ge=1) = RouterSpec.port
    policy: yamlconfig.name() = RouterSpec.policy
    args: yamlconfig.flags = ()
    policy_args: dict[str, yamlconfig.flags] = {}
    log_level: yamlconfig.name() | None = None

    @field_validator("port")
    @classmethod
    def _port(cls, value: int) -> int:
        if not 1 <= value <= 65535:
            raise ValueError(f"expected a port in 1..65535, got {value!r}")
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str | None) -> str | None:
        if value is not None and value.upper() not in LOG_LEVELS:
            raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {value.upper()!r}")
        return None if value is None else value.upper()


class EmulationFile(yamlconfig.Schema):
    """The emulation spec (module docstring), as written."""

    name: _Name | None = None
    model: yamlconfig.name()
    method: Literal["tc", "pacing"] = "tc"
    worker_args: yamlconfig.flags = ()
    workers: list[_WorkerEntry]
    topology: TopologyFile
    router: _RouterEntry = _RouterEntry()


def load_topology(path: str | Path) -> TopologySpec:
    """Parse and validate a topology spec; EmulationSpecError names file, line and field."""
    path = Path(path)
    doc = yamlconfig.read(path, EmulationSpecError)
    if doc.data is None:
        raise EmulationSpecError(str(path), None, None, "the spec is empty")
    spec = yamlconfig.validate(doc, EmulationFile)
    topo = spec.topology

    nodes = tuple(topo.nodes)
    for i, node in enumerate(nodes):
        if not _NAME.match(node):
            raise doc.error(("topology", "nodes", i), f"{node!r}: use letters, digits, '.', '_' and '-'")
        if node in nodes[:i]:
            raise doc.error(("topology", "nodes", i), f"node {node!r} is listed twice")
    if not nodes:
        raise doc.error(("topology", "nodes"), "needs at least one node", at_key=True)
    if topo.workers:
        raise doc.error(("topology", "workers"), "give each worker's node in workers[i].node", at_key=True)

    workers: list[WorkerSpec] = []
    for i, w in enumerate(spec.workers):
        if w.node not in nodes:
            raise doc.error(("workers", i, "node"), f"unknown node {w.node!r}; nodes: {', '.join(nodes)}")
        if any(other.id == w.id for other in workers):
            raise doc.error(("workers", i, "id"), f"worker id {w.id!r} is used twice")
        workers.append(WorkerSpec(w.id, w.role, w.node))
    roles = {w.role for w in workers}
    if not ({"prefill", "decode"} <= roles or roles == {"mixed"}):
        raise doc.error(("workers",), "needs at least one prefill and one decode worker (or only mixed workers)")

    # tc holds a link in both directions: node pairs only, each once
    links: dict[tuple[str, str], LinkSpec] = {}
    default_latency = topo.defaults.remote_latency_ms
    for i, entry in enumerate(topo.links):
        where = ("topology", "links", i)
        if entry.between is None:
            raise doc.error(where, "an emulated link holds both directions: give between: [a, b], not from:/to:")
        a, b = entry.between
        for end, value in enumerate((a, b)):
            if value not in nodes:
                raise doc.error(where + ("between", end), f"unknown node {value!r}; nodes: {', '.join(nodes)}")
        if a == b:
            raise doc.error(where, f"a link needs two different nodes, got {a!r} twice")
        key = tuple(sorted((a, b)))
        if key in links:
            raise doc.error(where, f"the link {a}-{b} is given twice")
        links[key] = LinkSpec(entry.gbps, default_latency if entry.latency_ms is None else entry.latency_ms)
    # unlisted pairs are shaped only when the file gives defaults.remote_gbps
    default_link = (LinkSpec(topo.defaults.remote_gbps, default_latency)
                    if "remote_gbps" in topo.defaults.model_fields_set else None)

    r = spec.router
    router = RouterSpec(r.port, r.policy, r.args, dict(r.policy_args), r.log_level)
    return TopologySpec(name=spec.name or path.stem, model=spec.model, nodes=nodes, workers=tuple(workers),
                        links=links, default_link=default_link, method=spec.method, worker_args=spec.worker_args,
                        router=router, path=str(path))
