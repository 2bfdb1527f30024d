"""Placement policies beyond the two in router.placement, and `build_policy` for the CLI.

    policy = build_policy("network-aware", topology_path="topo.yaml", profile_path="profile.json",
                          slo_ttft=1.0, slo_tpot=0.1)

Every policy lives in router.placement's registry (`POLICIES`, `make_policy`):
round-robin, least-loaded, random, power-of-two, prefix-aware, network-aware.
"""

from __future__ import annotations

from router.placement import POLICIES, PlacementPolicy, make_policy
from router.policies.baselines import PowerOfTwo, PrefixAware, PrefixIndex, RandomChoice
from router.policies.network_aware import NetworkAware
from router.profiles import load_profile
from router.topology import load_topology

__all__ = ["NetworkAware", "PowerOfTwo", "PrefixAware", "PrefixIndex", "RandomChoice", "build_policy"]

_SEEDED = ("random", "power-of-two")


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
) -> PlacementPolicy:
    """The policy `name` from command-line settings; ValueError names the flag or file at fault.

    - `topology_path` (any policy): links and the worker -> node map. The network-aware policy
      prices transfers with it; with any policy the router keeps per-link gauges by it.
    - `profile_path`, `slo_ttft`, `slo_tpot`, `admission_control`: network-aware only (it refuses
      to start without a profile); given to another policy they are an error, not ignored.
    - `seed`: random and power-of-two; the deterministic policies do not draw.
    - `max_batch`: the workers' --max-num-seqs, for network-aware's model of hybrid clusters.
    - `calibrate`: network-aware corrects its model from request outcomes
      (router.policies.calibration); False (--no-calibration) keeps the offline profile alone.
    """
    if name not in POLICIES:
        raise ValueError(f"--policy: unknown placement policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    topology = load_topology(topology_path) if topology_path is not None else None
    options: dict[str, object] = {}
    if name == NetworkAware.name:
        if profile_path is None:
            raise ValueError("--profile: network-aware needs --profile (a file from `pdserve profile`)")
        options.update(profile=load_profile(profile_path), topology=topology, slo_ttft=slo_ttft,
                       slo_tpot=slo_tpot, admission_control=admission_control, calibrate=calibrate)
        if max_batch is not None:
            options["max_batch"] = max_batch
    else:
        given = [flag for flag, value in (("--profile", profile_path), ("--slo-ttft", slo_ttft),
                                          ("--slo-tpot", slo_tpot), ("--admission-control", admission_control or None),
                                          ("--no-calibration", None if calibrate else True))
                 if value is not None]
        if given:
            raise ValueError(f"{given[0]}: only the network-aware policy uses it, not {name!r}")
        if name in _SEEDED:
            options["seed"] = seed
    policy = make_policy(name, **options)
    if topology is not None:
        policy.topology = topology
    return policy
