"""The simulated cluster: a YAML file in, a frozen `ClusterConfig` out.

    profile: profile.json           # `pdserve profile` output; paths are relative to this file
    decode_profile: other.json      # optional: decode and mixed workers step by this one
    topology: topology.yaml         # router topology file (router.placement.topology), or inline mapping
    mode: disaggregated             # or colocated
    engine: {num_blocks: 728, block_size: 16, max_num_batched_tokens: 512, max_num_seqs: 64}
                                    # (+ overlap_steps: true for a GPU engine's overlapped decode steps)
    workers:                        # or `cluster: 2P2D` (prefill-0.., decode-0.., one node each)
      - {id: p0, role: prefill, node: node0, host: box}
                                    # (+ tp: N, a tensor-parallel worker of N GPUs: sim.worker.tp_step_scale)
    hosts: {box: 2}                 # optional: workers sharing this many CPU cores
    router:
      stats_interval_s: 0.5         # how often the router polls worker stats
      rpc_s: 0.0                    # one-way latency of each router<->worker call
      front_s: 0.0                  # client -> router path before placement (HTTP, tokenising), once a request
      max_retries: 2
      policy_options:               # per policy, as `make_policy` takes them
        network-aware: {slo_ttft: 2.5, slo_tpot: 0.5}

Unknown keys and bad values raise ValueError naming the file and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import yaml

from router.placement.profiles import Profile, load_profile
from router.placement.topology import Topology, load_topology, parse_topology

_TOP = ("profile", "decode_profile", "topology", "mode", "engine", "workers", "cluster", "hosts", "router")
_ENGINE = ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "overlap_steps")
_ROUTER = ("stats_interval_s", "rpc_s", "front_s", "max_retries", "policy_options")
_WORKER = ("id", "role", "node", "host", "tp")
_SHAPE = re.compile(r"^\s*(\d+)\s*P\s*(\d+)\s*D\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    role: str
    node: str = ""
    host: str | None = None
    tp: int = 1  # ranks (GPUs) of the worker's engine


@dataclass(frozen=True)
class EngineLimits:
    num_blocks: int = 4096
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # the engine's overlapped decode steps (pdserve/engine.py; on by default on a GPU, where
    # decode-only steps replay CUDA graphs): a decode-only step started while nothing waits has
    # the next decode-only step launched behind it, so a request arriving meanwhile waits for both
    overlap_steps: bool = False


@dataclass(frozen=True)
class RouterConfig:
    stats_interval_s: float = 0.5
    rpc_s: float = 0.0
    max_retries: int = 2
    front_s: float = 0.0  # from the client's send to the placement (HTTP, tokenising the prompt, the router)
    policy_options: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class ClusterConfig:
    profile: Profile
    workers: tuple[WorkerConfig, ...]
    topology: Topology = field(default_factory=Topology)
    decode_profile: Profile | None = None
    mode: str = "disaggregated"
    engine: EngineLimits = field(default_factory=EngineLimits)
    hosts: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        ids = [w.worker_id for w in self.workers]
        if not ids:
            raise ValueError("workers: the cluster needs at least one worker")
        if len(set(ids)) != len(ids):
            raise ValueError(f"workers: ids must be unique, got {ids}")
        for w in self.workers:
            if w.role not in ("prefill", "decode", "mixed"):
                raise ValueError(f"workers.{w.worker_id}.role must be prefill, decode or mixed, got {w.role!r}")
            if w.host is not None and w.host not in self.hosts:
                raise ValueError(f"workers.{w.worker_id}.host: unknown host {w.host!r}; hosts: {sorted(self.hosts)}")
        for name, cores in self.hosts.items():
            if isinstance(cores, bool) or not isinstance(cores, (int, float)) or cores <= 0:
                raise ValueError(f"hosts.{name} must be a number of cores > 0, got {cores!r}")

    def with_shape(self, prefill: int, decode: int) -> "ClusterConfig":
        """The same cluster with `prefill` + `decode` workers, one node each (a spec's grid.cluster)."""
        return replace(self, workers=shape_workers(prefill, decode))


def shape_workers(prefill: int, decode: int) -> tuple[WorkerConfig, ...]:
    return tuple([WorkerConfig(f"prefill-{i}", "prefill", f"node-p{i}") for i in range(prefill)]
                 + [WorkerConfig(f"decode-{i}", "decode", f"node-d{i}") for i in range(decode)])


def _fail(path: str, key: str, message: str) -> ValueError:
    return ValueError(f"{path}: {key}: {message}")


def _check_keys(path: str, where: str, data: Any, allowed: tuple[str, ...]) -> dict:
    if not isinstance(data, dict):
        raise _fail(path, where or "the file", "must be a mapping")
    for key in data:
        if key not in allowed:
            raise _fail(path, f"{where}.{key}" if where else str(key), f"unknown key; allowed: {', '.join(allowed)}")
    return data


def _positive_int(path: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(path, key, f"must be a positive integer, got {value!r}")
    return value


def _non_negative(path: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise _fail(path, key, f"must be a number >= 0, got {value!r}")
    return float(value)


def load_cluster(path: str | Path) -> ClusterConfig:
    """Reads a cluster file (module docstring); ValueError names the file and the key."""
    path = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the cluster file: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    data = _check_keys(path, "", data, _TOP)
    base = Path(path).resolve().parent
    if "profile" not in data:
        raise _fail(path, "profile", "missing (a file from `pdserve profile`)")
    profile = load_profile(str(base / str(data["profile"])))
    decode_profile = load_profile(str(base / str(data["decode_profile"]))) if data.get("decode_profile") else None

    topo = data.get("topology")
    if topo is None:
        topology = Topology()
    elif isinstance(topo, str):
        topology = load_topology(str(base / topo))
    elif isinstance(topo, dict):
        topology = parse_topology(yaml.safe_dump(topo), f"{path}: topology")
    else:
        raise _fail(path, "topology", "must be a file name or a mapping")

    engine_data = _check_keys(path, "engine", data.get("engine") or {}, _ENGINE)
    for k, v in engine_data.items():
        if k == "overlap_steps" and not isinstance(v, bool):
            raise _fail(path, "engine.overlap_steps", f"must be true or false, got {v!r}")
    engine = EngineLimits(**{k: v if k == "overlap_steps" else _positive_int(path, f"engine.{k}", v)
                             for k, v in engine_data.items()})

    hosts = _check_keys(path, "hosts", data.get("hosts") or {}, tuple(data.get("hosts") or {}))
    if "workers" in data and "cluster" in data:
        raise _fail(path, "workers", "give workers or cluster, not both")
    if "workers" in data:
        if not isinstance(data["workers"], list):
            raise _fail(path, "workers", "must be a list")
        workers = []
        for i, item in enumerate(data["workers"]):
            item = _check_keys(path, f"workers[{i}]", item, _WORKER)
            if "id" not in item or "role" not in item:
                raise _fail(path, f"workers[{i}]", "needs id and role")
            tp = item.get("tp", 1)
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
                raise _fail(path, f"workers[{i}].tp", f"must be a positive integer, got {tp!r}")
            workers.append(WorkerConfig(str(item["id"]), str(item["role"]), str(item.get("node") or ""),
                                        item.get("host"), tp))
        workers = tuple(workers)
    else:
        shape = _SHAPE.match(str(data.get("cluster", "1P1D")))
        if not shape:
            raise _fail(path, "cluster", f"expected a shape like 2P2D, got {data.get('cluster')!r}")
        workers = shape_workers(int(shape[1]), int(shape[2]))

    router_data = _check_keys(path, "router", data.get("router") or {}, _ROUTER)
    options = router_data.get("policy_options") or {}
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise _fail(path, "router.policy_options", "must map policy names to option mappings")
    router = RouterConfig(
        stats_interval_s=_non_negative(path, "router.stats_interval_s", router_data.get("stats_interval_s", 0.5)),
        rpc_s=_non_negative(path, "router.rpc_s", router_data.get("rpc_s", 0.0)),
        front_s=_non_negative(path, "router.front_s", router_data.get("front_s", 0.0)),
        max_retries=int(_non_negative(path, "router.max_retries", router_data.get("max_retries", 2))),
        policy_options=MappingProxyType({k: MappingProxyType(dict(v)) for k, v in options.items()}),
    )
    try:
        return ClusterConfig(profile=profile, decode_profile=decode_profile, workers=workers, topology=topology,
                             mode=str(data.get("mode", "disaggregated")), engine=engine,
                             hosts=MappingProxyType(dict(hosts)), router=router)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def scale_profile(profile: Profile, *, time_factor: float = 1.0, kv_bytes_per_token: int | None = None,
                  num_layers: int | None = None, label: str = "", prefill_factor: float | None = None,
                  decode_factor: float | None = None, mixed_factor: float | None = None) -> Profile:
    """A profile derived from a measured one: every step time x `time_factor` (prefill times x
    `prefill_factor`, decode steps x `decode_factor` and the mixed table's steps, if it has one,
    x `mixed_factor` where given), optionally another KV size and layer count. The model name
    records the derivation (`label`), so reports say the figures come from a scaled profile,
    not a measurement."""
    prefill_factor = time_factor if prefill_factor is None else prefill_factor
    decode_factor = time_factor if decode_factor is None else decode_factor
    mixed_factor = time_factor if mixed_factor is None else mixed_factor
    for name, value in (("time_factor", time_factor), ("prefill_factor", prefill_factor),
                        ("decode_factor", decode_factor), ("mixed_factor", mixed_factor)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    default = (f"times x{time_factor:g}" if prefill_factor == decode_factor == time_factor
               else f"prefill x{prefill_factor:g}, decode x{decode_factor:g}")
    return replace(
        profile,
        model=f"{profile.model} scaled ({label or default})",
        prefill_times=tuple(t * prefill_factor for t in profile.prefill_times),
        decode_times=tuple(tuple(t * decode_factor for t in row) for row in profile.decode_times),
        mixed_times=tuple(tuple(t * mixed_factor for t in row) for row in profile.mixed_times),
        kv_bytes_per_token=kv_bytes_per_token or profile.kv_bytes_per_token,
        num_layers=num_layers or profile.num_layers,
    )
