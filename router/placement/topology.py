"""Topology: nodes, the worker -> node map, and the links between nodes (capacity, latency).

Pure data: frozen dataclasses, no I/O except `load_topology`, which reads the YAML file.

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

import yaml


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


# ---------------------------------------------------------------- YAML

_TOP_KEYS = ("defaults", "nodes", "workers", "links")
_DEFAULT_KEYS = ("local_gbps", "local_latency_ms", "remote_gbps", "remote_latency_ms")
_LINK_KEYS = ("between", "from", "to", "gbps", "latency_ms")


class _Reader:
    """Walks the composed YAML nodes, so that every error names the line of the bad field."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.loader = yaml.SafeLoader(text)

    def root(self) -> yaml.Node | None:
        try:
            return self.loader.get_single_node()
        except yaml.YAMLError as exc:
            raise ValueError(f"{self.path}: not valid YAML: {exc}") from None

    def fail(self, node: yaml.Node, field_name: str, message: str) -> ValueError:
        return ValueError(f"{self.path}:{node.start_mark.line + 1}: {field_name}: {message}")

    def mapping(
        self, node: yaml.Node, field_name: str, allowed: tuple[str, ...] | None,
    ) -> list[tuple[str, yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, field_name, "must be a mapping")
        items = []
        seen = set()
        for key_node, value_node in node.value:
            key = self.scalar(key_node, field_name)
            name = f"{field_name}.{key}" if field_name else str(key)
            if not isinstance(key, str):
                raise self.fail(key_node, name, "keys must be strings")
            if allowed is not None and key not in allowed:
                raise self.fail(key_node, name, f"unknown key; allowed: {', '.join(allowed)}")
            if key in seen:
                raise self.fail(key_node, name, "given twice")
            seen.add(key)
            items.append((key, key_node, value_node))
        return items

    def sequence(self, node: yaml.Node, field_name: str) -> list[yaml.Node]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.fail(node, field_name, "must be a list")
        return list(node.value)

    def scalar(self, node: yaml.Node, field_name: str) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, field_name, "must be a single value")
        return self.loader.construct_object(node, deep=True)

    def name(self, node: yaml.Node, field_name: str) -> str:
        value = self.scalar(node, field_name)
        if not isinstance(value, str) or not value:
            raise self.fail(node, field_name, f"must be a non-empty name, got {value!r}")
        return value

    def number(self, node: yaml.Node, field_name: str, *, positive: bool) -> float:
        value = self.scalar(node, field_name)
        check = _check_positive if positive else _check_non_negative
        try:
            check(field_name, value)
        except ValueError as exc:
            raise self.fail(node, field_name, str(exc).removeprefix(f"{field_name} ")) from None
        return float(value)


def load_topology(path: str) -> Topology:
    """Reads a topology YAML file (module docstring); ValueError names the file, line and field."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the topology file: {exc.strerror or exc}") from None
    return parse_topology(text, path)


def parse_topology(text: str, path: str = "<topology>") -> Topology:
    r = _Reader(path, text)
    root = r.root()
    if root is None:
        return Topology()
    kwargs: dict[str, Any] = {}
    nodes: list[str] = []
    workers: dict[str, str] = {}
    links: list[Link] = []
    for key, _, value in r.mapping(root, "", _TOP_KEYS):
        if key == "defaults":
            for sub, _, v in r.mapping(value, "defaults", _DEFAULT_KEYS):
                kwargs[sub] = r.number(v, f"defaults.{sub}", positive=sub.endswith("gbps"))
        elif key == "nodes":
            for i, item in enumerate(r.sequence(value, "nodes")):
                nodes.append(r.name(item, f"nodes[{i}]"))
        elif key == "workers":
            for worker_id, _, v in r.mapping(value, "workers", None):
                workers[worker_id] = r.name(v, f"workers.{worker_id}")
        else:
            for i, item in enumerate(r.sequence(value, "links")):
                links.extend(_parse_link(r, item, f"links[{i}]", kwargs.get("remote_latency_ms", 0.1)))
    for name in [*workers.values(), *(n for link in links for n in (link.src, link.dst))]:
        if name not in nodes:
            nodes.append(name)
    try:
        return Topology(links=tuple(links), workers=workers, nodes=tuple(nodes), **kwargs)
    except ValueError as exc:
        raise ValueError(f"{path}: links: {exc}") from None


def _parse_link(r: _Reader, node: yaml.Node, where: str, default_latency_ms: float) -> list[Link]:
    items = {key: (key_node, value) for key, key_node, value in r.mapping(node, where, _LINK_KEYS)}
    if "gbps" not in items:
        raise r.fail(node, f"{where}.gbps", "missing (the link capacity in Gbit/s)")
    gbps = r.number(items["gbps"][1], f"{where}.gbps", positive=True)
    latency = default_latency_ms
    if "latency_ms" in items:
        latency = r.number(items["latency_ms"][1], f"{where}.latency_ms", positive=False)
    if "between" in items:
        if "from" in items or "to" in items:
            raise r.fail(node, where, "give either between: [a, b] or from:/to:, not both")
        ends = r.sequence(items["between"][1], f"{where}.between")
        if len(ends) != 2:
            raise r.fail(items["between"][1], f"{where}.between", f"must name 2 nodes, got {len(ends)}")
        a, b = (r.name(e, f"{where}.between") for e in ends)
        if a == b:
            return [Link(a, a, gbps, latency)]
        return [Link(a, b, gbps, latency), Link(b, a, gbps, latency)]
    if "from" not in items or "to" not in items:
        raise r.fail(node, where, "needs between: [a, b] or both from: and to:")
    return [Link(r.name(items["from"][1], f"{where}.from"), r.name(items["to"][1], f"{where}.to"), gbps, latency)]
