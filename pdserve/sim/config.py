"""The simulated cluster: a YAML file in, a frozen `ClusterConfig` out.

    profile: profile.json           # `pdserve profile` output; paths are relative to this file
    decode_profile: other.json      # optional: decode and mixed workers step by this one
    hardware: AMD EPYC (1 threads)  # optional: the hardware this cluster runs on; the profiles must
                                    # name it (pdserve/sim/profile_check.py; default: this machine's)
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

Read through yamlconfig (schema: `ClusterFile`); unknown keys and bad values raise ValueError
naming the file, the line and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from pdserve.loadgen import yamlconfig
from pdserve.router.placement.profiles import Profile, load_profile
from pdserve.router.placement.topology import Topology, load_topology, topology_from

_SHAPE = re.compile(r"^\s*(\d+)\s*P\s*(\d+)\s*D\s*$", re.IGNORECASE)
_PositiveInt = yamlconfig.whole(ge=1)
_Seconds = yamlconfig.number(ge=0)


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
    hardware: str = ""  # the hardware the cluster file says it runs on ("": not said)
    profile_path: str = ""  # where the profiles were read, for messages ("": built in code)
    decode_profile_path: str = ""

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


# ---------------------------------------------------------------- the file's schema

class _WorkerEntry(yamlconfig.Schema):
    id: yamlconfig.text
    role: yamlconfig.text
    node: yamlconfig.text = ""
    host: yamlconfig.text | None = None
    tp: _PositiveInt = 1  # ranks (GPUs) of the worker's engine


class _EngineEntry(yamlconfig.Schema):
    num_blocks: _PositiveInt = EngineLimits.num_blocks
    block_size: _PositiveInt = EngineLimits.block_size
    max_num_batched_tokens: _PositiveInt = EngineLimits.max_num_batched_tokens
    max_num_seqs: _PositiveInt = EngineLimits.max_num_seqs
    overlap_steps: yamlconfig.Bool = False


class _RouterEntry(yamlconfig.Schema):
    stats_interval_s: _Seconds = RouterConfig.stats_interval_s
    rpc_s: _Seconds = RouterConfig.rpc_s
    front_s: _Seconds = RouterConfig.front_s
    max_retries: yamlconfig.whole(ge=0) = RouterConfig.max_retries
    policy_options: dict[str, dict[str, Any]] = {}


class ClusterFile(yamlconfig.Schema):
    """The cluster file (module docstring), as written."""

    profile: yamlconfig.text
    decode_profile: yamlconfig.text | None = None
    hardware: yamlconfig.text = ""  # a device name as `pdserve profile` writes it
    topology: Any = None  # a file name or an inline topology (router.placement.topology.TopologyFile)
    mode: yamlconfig.text = "disaggregated"
    engine: _EngineEntry = _EngineEntry()
    workers: list[_WorkerEntry] | None = None
    cluster: yamlconfig.text | None = None
    hosts: dict[str, Any] = {}
    router: _RouterEntry = _RouterEntry()


def load_cluster(path: str | Path) -> ClusterConfig:
    """Reads a cluster file (module docstring); ValueError names the file and the key."""
    path = str(path)
    doc = yamlconfig.read(path, what="the cluster file")
    spec = yamlconfig.validate(doc, ClusterFile)
    base = Path(path).resolve().parent
    profile_path = str(base / spec.profile)
    profile = load_profile(profile_path)
    decode_profile_path = str(base / spec.decode_profile) if spec.decode_profile else ""
    decode_profile = load_profile(decode_profile_path) if decode_profile_path else None

    if spec.topology is None:
        topology = Topology()
    elif isinstance(spec.topology, str):
        topology = load_topology(str(base / spec.topology))
    elif isinstance(spec.topology, dict):
        topology = topology_from(doc, spec.topology, ("topology",))
    else:
        raise doc.error(("topology",), "must be a file name or a mapping")

    if spec.workers is not None and spec.cluster is not None:
        raise doc.error(("workers",), "give workers or cluster, not both")
    if spec.workers is not None:
        workers = tuple(WorkerConfig(w.id, w.role, w.node, w.host, w.tp) for w in spec.workers)
    else:
        shape = _SHAPE.match(spec.cluster or "1P1D")
        if not shape:
            raise doc.error(("cluster",), f"expected a shape like 2P2D, got {spec.cluster!r}")
        workers = shape_workers(int(shape[1]), int(shape[2]))

    r = spec.router
    router = RouterConfig(
        stats_interval_s=r.stats_interval_s, rpc_s=r.rpc_s, front_s=r.front_s, max_retries=r.max_retries,
        policy_options=MappingProxyType({k: MappingProxyType(dict(v)) for k, v in r.policy_options.items()}),
    )
    engine = EngineLimits(**spec.engine.model_dump())
    try:
        return ClusterConfig(profile=profile, decode_profile=decode_profile, workers=workers, topology=topology,
                             mode=spec.mode, engine=engine, hosts=MappingProxyType(dict(spec.hosts)), router=router,
                             hardware=spec.hardware, profile_path=profile_path, decode_profile_path=decode_profile_path)
    except ValueError as exc:
        raise yamlconfig.ConfigError(path, None, None, str(exc)) from None


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
