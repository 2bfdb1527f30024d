"""Topology spec of an emulated cluster: YAML in, a frozen dataclass out; errors read
``file:line: field 'links[0].gbps': problem``. Unknown keys are rejected.

    name: str = file stem
    model: str                       # `pdserve worker --model` (and the router's tokenizer)
    method: tc | pacing = tc         # who holds the links (shaping.py / pacing_spec.py)
    worker_args: [str] = []          # extra `pdserve worker` flags, e.g. [--kv-cache-gib, "0.05"]
    nodes: [str]                     # node names (letters, digits, . _ -)
    workers:                         # at least one prefill and one decode
      - {id: p0, role: prefill | decode | mixed, node: <node>}
    links:                           # node pairs; a pair not listed takes default_link
      - {a: <node>, b: <node>, gbps: number > 0, latency_ms: number >= 0 = 0}
    default_link: {gbps, latency_ms} # optional; without it unlisted pairs are unshaped
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
from typing import Any

import yaml

from launcher.emulation.errors import EmulationSpecError
from launcher.emulation.netns import LinkSpec

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


class _Doc:
    """The composed YAML tree: values plus their lines, addressed by dotted paths."""

    def __init__(self, path: str, text: str):
        self.path = path
        try:
            self.root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            raise EmulationSpecError(path, mark.line + 1 if mark else None, None,
                                     f"invalid YAML: {e.problem or e.context}") from None
        except yaml.YAMLError as e:
            raise EmulationSpecError(path, None, None, f"invalid YAML: {e}") from None

    def error(self, node: yaml.Node | None, field_: str | None, message: str) -> EmulationSpecError:
        return EmulationSpecError(self.path, node.start_mark.line + 1 if node is not None else None, field_, message)

    def mapping(self, node: yaml.Node, where: str, allowed: tuple[str, ...]) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, where or None, "expected a mapping")
        out = {}
        for key, value in node.value:
            name = key.value
            if name not in allowed:
                raise self.error(key, _join(where, name), f"unknown key; expected one of: {', '.join(allowed)}")
            if name in out:
                raise self.error(key, _join(where, name), "given twice")
            out[name] = (key, value)
        return out

    def scalar(self, node: yaml.Node, where: str) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.error(node, where, "expected a single value")
        return yaml.constructor.SafeConstructor().construct_object(node, deep=True)

    def string(self, node: yaml.Node, where: str, pattern: re.Pattern | None = None) -> str:
        value = self.scalar(node, where)
        if not isinstance(value, str) or not value:
            raise self.error(node, where, f"expected a non-empty string, got {value!r}")
        if pattern is not None and not pattern.match(value):
            raise self.error(node, where, f"{value!r}: use letters, digits, '.', '_' and '-'")
        return value

    def number(self, node: yaml.Node, where: str, minimum: float, strict: bool) -> float:
        value = self.scalar(node, where)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(node, where, f"expected a number, got {value!r}")
        if value < minimum or (strict and value == minimum):
            raise self.error(node, where, f"must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
        return float(value)

    def sequence(self, node: yaml.Node, where: str) -> list[yaml.Node]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.error(node, where, "expected a list")
        return node.value


def _join(where: str, key: str | int) -> str:
    return f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else key)


def _link(doc: _Doc, node: yaml.Node, where: str, with_nodes: bool) -> tuple[tuple[str, str] | None, LinkSpec]:
    keys = ("a", "b", "gbps", "latency_ms") if with_nodes else ("gbps", "latency_ms")
    m = doc.mapping(node, where, keys)
    pair = None
    if with_nodes:
        for k in ("a", "b"):
            if k not in m:
                raise doc.error(node, _join(where, k), "required")
        pair = (doc.string(m["a"][1], _join(where, "a")), doc.string(m["b"][1], _join(where, "b")))
    if "gbps" not in m:
        raise doc.error(node, _join(where, "gbps"), "required (the link's set rate in Gbit/s)")
    gbps = doc.number(m["gbps"][1], _join(where, "gbps"), 0.0, strict=True)
    latency = doc.number(m["latency_ms"][1], _join(where, "latency_ms"), 0.0, strict=False) if "latency_ms" in m else 0.0
    return pair, LinkSpec(gbps, latency)


def _args(doc: _Doc, node: yaml.Node, where: str) -> tuple[str, ...]:
    out = []
    for i, item in enumerate(doc.sequence(node, where)):
        value = doc.scalar(item, _join(where, i))
        if isinstance(value, (dict, list)) or value is None:
            raise doc.error(item, _join(where, i), "expected a flag or value")
        out.append(str(value).lower() if isinstance(value, bool) else str(value))
    return tuple(out)


def load_topology(path: str | Path) -> TopologySpec:
    """Parse and validate a topology spec; EmulationSpecError names file, line and field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise EmulationSpecError(str(path), None, None, f"cannot read: {e.strerror or e}") from None
    doc = _Doc(str(path), text)
    if doc.root is None:
        raise EmulationSpecError(str(path), None, None, "the spec is empty")
    top = doc.mapping(doc.root, "", ("name", "model", "method", "worker_args", "nodes", "workers", "links",
                                     "default_link", "router"))
    for key in ("model", "nodes", "workers"):
        if key not in top:
            raise doc.error(doc.root, key, "required")
    name = doc.string(top["name"][1], "name", _NAME) if "name" in top else path.stem
    model = doc.string(top["model"][1], "model")
    method = doc.string(top["method"][1], "method") if "method" in top else "tc"
    if method not in METHODS:
        raise doc.error(top["method"][1], "method", f"expected one of {', '.join(METHODS)}, got {method!r}")
    worker_args = _args(doc, top["worker_args"][1], "worker_args") if "worker_args" in top else ()

    nodes: list[str] = []
    for i, item in enumerate(doc.sequence(top["nodes"][1], "nodes")):
        node = doc.string(item, f"nodes[{i}]", _NAME)
        if node in nodes:
            raise doc.error(item, f"nodes[{i}]", f"node {node!r} is listed twice")
        nodes.append(node)
    if not nodes:
        raise doc.error(top["nodes"][1], "nodes", "needs at least one node")

    workers: list[WorkerSpec] = []
    for i, item in enumerate(doc.sequence(top["workers"][1], "workers")):
        where = f"workers[{i}]"
        m = doc.mapping(item, where, ("id", "role", "node"))
        for k in ("id", "role", "node"):
            if k not in m:
                raise doc.error(item, f"{where}.{k}", "required")
        wid = doc.string(m["id"][1], f"{where}.id", _NAME)
        role = doc.string(m["role"][1], f"{where}.role")
        node = doc.string(m["node"][1], f"{where}.node")
        if role not in ROLES:
            raise doc.error(m["role"][1], f"{where}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        if node not in nodes:
            raise doc.error(m["node"][1], f"{where}.node", f"unknown node {node!r}; nodes: {', '.join(nodes)}")
        if any(w.id == wid for w in workers):
            raise doc.error(m["id"][1], f"{where}.id", f"worker id {wid!r} is used twice")
        workers.append(WorkerSpec(wid, role, node))
    roles = {w.role for w in workers}
    if not ({"prefill", "decode"} <= roles or roles == {"mixed"}):
        raise doc.error(top["workers"][1], "workers", "needs at least one prefill and one decode worker "
                                                      "(or only mixed workers)")

    links: dict[tuple[str, str], LinkSpec] = {}
    if "links" in top:
        for i, item in enumerate(doc.sequence(top["links"][1], "links")):
            where = f"links[{i}]"
            (a, b), spec = _link(doc, item, where, with_nodes=True)
            for end, value in (("a", a), ("b", b)):
                if value not in nodes:
                    raise doc.error(item, f"{where}.{end}", f"unknown node {value!r}; nodes: {', '.join(nodes)}")
            if a == b:
                raise doc.error(item, where, f"a link needs two different nodes, got {a!r} twice")
            key = tuple(sorted((a, b)))
            if key in links:
                raise doc.error(item, where, f"the link {a}-{b} is given twice")
            links[key] = spec
    default_link = _link(doc, top["default_link"][1], "default_link", with_nodes=False)[1] \
        if "default_link" in top else None

    router = RouterSpec()
    if "router" in top:
        m = doc.mapping(top["router"][1], "router", ("port", "policy", "args", "policy_args", "log_level"))
        port = router.port
        if "port" in m:
            port = doc.scalar(m["port"][1], "router.port")
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise doc.error(m["port"][1], "router.port", f"expected a port in 1..65535, got {port!r}")
        policy = doc.string(m["policy"][1], "router.policy") if "policy" in m else router.policy
        args = _args(doc, m["args"][1], "router.args") if "args" in m else ()
        policy_args: dict[str, tuple[str, ...]] = {}
        if "policy_args" in m:
            node = m["policy_args"][1]
            if not isinstance(node, yaml.MappingNode):
                raise doc.error(node, "router.policy_args", "expected a mapping of policy name -> list of flags")
            for key, value in node.value:
                name = doc.string(key, "router.policy_args")
                if name in policy_args:
                    raise doc.error(key, f"router.policy_args.{name}", "given twice")
                policy_args[name] = _args(doc, value, f"router.policy_args.{name}")
        log_level = None
        if "log_level" in m:
            log_level = doc.string(m["log_level"][1], "router.log_level").upper()
            if log_level not in LOG_LEVELS:
                raise doc.error(m["log_level"][1], "router.log_level",
                                f"expected one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
        router = RouterSpec(port, policy, args, policy_args, log_level)
    return TopologySpec(name=name, model=model, nodes=tuple(nodes), workers=tuple(workers), links=links,
                        default_link=default_link, method=method, worker_args=worker_args, router=router,
                        path=str(path))
