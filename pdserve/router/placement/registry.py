"""The placement policies by name, and `build_policy` for the CLI.

    policy = make_policy("least-loaded", local_prefill_max_tokens=32)
    policy = build_policy("network-aware", topology_path="topo.yaml", profile_path="profile.json",
                          slo_ttft=1.0, slo_tpot=0.1)

`POLICIES` maps each name to "module:Class"; a policy's module is imported only when the
policy is built, so no policy imports this module and this module imports no policy at its
top: the registry closes no import circle. tests/router/test_placement.py checks that every
entry names a class whose `name` is the entry's.
"""

from __future__ import annotations

import importlib
import inspect

from pdserve.router.placement.base import PlacementPolicy
from pdserve.router.placement.profiles import load_profile
from pdserve.router.placement.topology import load_topology

POLICIES: dict[str, str] = {
    "round-robin": "pdserve.router.placement.base:RoundRobin",
    "least-loaded": "pdserve.router.placement.base:LeastLoaded",
    "random": "pdserve.router.placement.policies.baselines:RandomChoice",
    "power-of-two": "pdserve.router.placement.policies.baselines:PowerOfTwo",
    "prefix-aware": "pdserve.router.placement.policies.baselines:PrefixAware",
    "network-aware": "pdserve.router.placement.policies.network_aware:NetworkAware",
}

_SEEDED = ("random", "power-of-two")
_PROFILED = "network-aware"


def policy_class(name: str) -> type[PlacementPolicy]:
    """The class registered as `name`; unknown names raise ValueError."""
    where = POLICIES.get(name)
    if where is None:
        raise ValueError(f"unknown placement policy {name!r}; choose one of {sorted(POLICIES)}")
    module, _, attr = where.partition(":")
    return getattr(importlib.import_module(module), attr)


def make_policy(name: str, **options: object) -> PlacementPolicy:
    """Builds the policy registered as `name`; unknown names and options raise ValueError."""
    cls = policy_class(name)
    accepted = {
        p.name for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
    }
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for placement policy {name!r}; accepted: {sorted(accepted)}")
    return cls(**options)


def build_policy(
    name: str,
    *,
    topology_path: str | None = None,
    profile_path: str | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    admission_control: bool = False,
    seed: int = 0,
    max_batch: int | None = None,
    calibrate: bool = True,
    kv_wire_precision: str = "auto",
    local_prefill: bool = True,
) -> PlacementPolicy:
    """The policy `name` from command-line settings; ValueError names the flag or file at fault.

    - `topology_path` (any policy): links and the worker -> node map. The network-aware policy
      prices transfers with it; with any policy the router keeps per-link gauges by it.
    - `profile_path`, `slo_ttft`, `slo_tpot`, `admission_control`: network-aware only (it refuses
      to start without a profile); given to another policy they are an error, not ignored.
    - `seed`: random and power-of-two; the deterministic policies do not draw.
    - `max_batch`: the workers' --max-num-seqs, for network-aware's model of hybrid clusters.
    - `calibrate`: network-aware corrects its model from request outcomes
      (router.placement.policies.calibration); False (--no-calibration) keeps the offline profile alone.
    - `local_prefill` (False: --no-local-prefill): network-aware only; a feasible pair always
      wins over a decode worker prefilling the prompt itself.
    - `kv_wire_precision` (--kv-wire-precision): network-aware prices transfers at it ("auto": the
      precision it chooses per request); the backend applies it with any policy.
    """
    if name not in POLICIES:
        raise ValueError(f"--policy: unknown placement policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    topology = load_topology(topology_path) if topology_path is not None else None
    options: dict[str, object] = {}
    if name == _PROFILED:
        if profile_path is None:
            raise ValueError("--profile: network-aware needs --profile (a file from `pdserve profile`)")
        options.update(profile=load_profile(profile_path), topology=topology, slo_ttft=slo_ttft,
                       slo_tpot=slo_tpot, admission_control=admission_control, calibrate=calibrate,
                       kv_wire_precision=kv_wire_precision, local_prefill=local_prefill)
        if max_batch is not None:
            options["max_batch"] = max_batch
    else:
        given = [flag for flag, value in (("--profile", profile_path), ("--slo-ttft", slo_ttft),
                                          ("--slo-tpot", slo_tpot), ("--admission-control", admission_control or None),
                                          ("--no-calibration", None if calibrate else True),
                                          ("--no-local-prefill", None if local_prefill else True))
                 if value is not None]
        if given:
            raise ValueError(f"{given[0]}: only the network-aware policy uses it, not {name!r}")
        if name in _SEEDED:
            options["seed"] = seed
    policy = make_policy(name, **options)
    if topology is not None:
        policy.topology = topology
    return policy
