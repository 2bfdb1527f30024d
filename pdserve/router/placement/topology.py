"""Topology: nodes, the worker -> node map, and the links between nodes (capacity, latency).

Pure data: frozen dataclasses, no I/O except `load_topology`, which reads the YAML file
(through yamlconfig, with the schema `TopologyFile` below).

    defaults:                 # all optional
      local_gbps: 200         # two workers on one node (NVLink, shared memory)
      local_latency_ms: 0.005
      remote_gbps: 10         # two nodes with no `links` entry
      remote_latency_ms: 0.1
    nodes: [a, b, c]          # optional; nodes named by workers/links are added
    workers:                  # worker id -> node (overrides the node a worker reports)
      prefill-0: a
      decode-0: b
    links:
      - between: [a, b]       # symmetric: a->b and b->a
        gbps: 100
        latency_ms: 0.01      # optional, default: remote_latency_ms
      - from: a               # directional: only a->c
        to: c
        gbps: 1

A link is directional (src node -> dst node): KV flows from the prefill node to the decode
node. Unknown keys and bad values raise ValueError naming the file, the line and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pydantic import Field, field_validator, model_validator

from pdserve.loadgen import yamlconfig


@dataclass(frozen=True)
class Link:
    src: str
    dst: str
    capacity_gbps: float
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        _check_positive(f"link {self.key} capacity_gbps", self.capacity_gbps)
        _check_non_negative(f"link {self.key} latency_ms", self.latency_ms)

    @property
    def key(self) -> str:
        return link_key(self.src, self.dst)


def link_key(src: str, dst: str) -> str:
    """The name of a directional link, as metrics label it: "src->dst"."""
    return f"{src}->{dst}"


@dataclass(frozen=True)
class Topology:
    """Links between nodes, with defaults for pairs that have no entry.

    A worker's node: `workers[worker_id]` if listed, else the node the worker reports, else the
    worker id itself (an unplaced worker is its own node, so it gets the remote default: never
    an optimistic local link by accident).
    """

    links: tuple[Link, ...] = ()
    workers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    nodes: tuple[str, ...] = ()
    local_gbps: float = 200.0
    local_latency_ms: float = 0.005
    remote_gbps: float = 10.0
    remote_latency_ms: float = 0.1

    def __post_init__(self) -> None:
        for name in ("local_gbps", "remote_gbps"):
            _check_positive(name, getattr(self, name))
        for name in ("local_latency_ms", "remote_latency_ms"):
            _check_non_negative(name, getattr(self, name))
        by_key: dict[str, Link] = {}
        for link in self.links:
            if link.key in by_key:
                raise ValueError(f"link {link.key} is given twice")
            by_key[link.key] = link
        object.__setattr__(self, "workers", MappingProxyType(dict(self.workers)))
        object.__setattr__(self, "_by_key", MappingProxyType(by_key))

    def node_of(self, worker_id: str, reported_node: str = "") -> str:
        return self.workers.get(worker_id) or reported_node or worker_id

    def link(self, src: str, dst: str) -> Link:
        """The link from node `src` to node `dst` (a default one when the file names none)."""
        found = self._by_key.get(link_key(src, dst))  # type: ignore[attr-defined]
        if found is not None:
            return found
        if src == dst:
            return Link(src, dst, self.local_gbps, self.local_latency_ms)
        return Link(src, dst, self.remote_gbps, self.remote_latency_ms)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


def _check_non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


# ---------------------------------------------------------------- the file's schema
# One topology schema for every file that describes links: the router's topology file, the
# `topology:` section of a simulated cluster (pdserve/sim/config.py) and of an emulation spec
# (pdserve/launcher/emulation/spec.py).

Gbps = yamlconfig.number(gt=0)
Millis = yamlconfig.number(ge=0)
NodeName = yamlconfig.name()


class LinkEntry(yamlconfig.Schema):
    """`{between: [a, b], gbps, latency_ms}` (both directions) or `{from: a, to: b, ...}`."""

    between: list[NodeName] | None = None
    src: NodeName | None = Field(None, alias="from")
    dst: NodeName | None = Field(None, alias="to")
    gbps: Gbps
    latency_ms: Millis | None = None  # None: defaults.remote_latency_ms

    @field_validator("between")
    @classmethod
    def _two_ends(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(value) != 2:
            raise ValueError(f"must name 2 nodes, got {len(value)}")
        return value

    @model_validator(mode="after")
    def _ends(self) -> "LinkEntry":
        if self.between is not None and (self.src is not None or self.dst is not None):
            raise ValueError("give either between: [a, b] or from:/to:, not both")
        if self.between is None and (self.src is None or self.dst is None):
            raise ValueError("needs between: [a, b] or both from: and to:")
        return self

    def links(self, default_latency_ms: float) -> list[Link]:
        latency = default_latency_ms if self.latency_ms is None else self.latency_ms
        if self.between is None:
            return [Link(self.src, self.dst, self.gbps, latency)]
        a, b = self.between
        return [Link(a, b, self.gbps, latency)] + ([Link(b, a, self.gbps, latency)] if a != b else [])


class TopologyDefaults(yamlconfig.Schema):
    local_gbps: Gbps = 200.0
    local_latency_ms: Millis = 0.005
    remote_gbps: Gbps = 10.0
    remote_latency_ms: Millis = 0.1


class TopologyFile(yamlconfig.Schema):
    """The topology file (module docstring), as written."""

    defaults: TopologyDefaults = TopologyDefaults()
    nodes: list[NodeName] = []
    workers: dict[str, NodeName] = {}
    links: list[LinkEntry] = []

    def build(self) -> Topology:
        """The Topology; ValueError (a link given twice) without the file's name."""
        d = self.defaults
        links = [link for entry in self.links for link in entry.links(d.remote_latency_ms)]
        nodes = list(self.nodes)
        for name in [*self.workers.values(), *(n for link in links for n in (link.src, link.dst))]:
            if name not in nodes:
                nodes.append(name)
        return Topology(links=tuple(links), workers=self.workers, nodes=tuple(nodes), local_gbps=d.local_gbps,
                        local_latency_ms=d.local_latency_ms, remote_gbps=d.remote_gbps,
                        remote_latency_ms=d.remote_latency_ms)


def topology_from(doc: yamlconfig.Document, data: Any = None, loc: tuple = ()) -> Topology:
    """The topology at `loc` of a read YAML document (the whole file by default)."""
    spec = yamlconfig.validate(doc, TopologyFile, data, loc)
    try:
        return spec.build()
    except ValueError as exc:
        raise doc.error(loc + ("links",), str(exc)) from None


def load_topology(path: str) -> Topology:
    """Reads a topology YAML file (module docstring); ValueError names the file, line and field."""
    return topology_from(yamlconfig.read(path, what="the topology file"))


def parse_topology(text: str, path: str = "<topology>") -> Topology:
    return topology_from(yamlconfig.Document(path, text))
