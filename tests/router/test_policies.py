"""Baselines (random, power-of-two, prefix-aware) and build_policy."""

from __future__ import annotations

import pytest

from pdserve.router.placement.registry import POLICIES
from pdserve.router.placement.base import ClusterSnapshot, Decision, RequestInfo, WorkerSnapshot
from pdserve.router.placement.policies.network_aware import NetworkAware
from pdserve.router.placement.policies.baselines import PowerOfTwo, PrefixAware, PrefixIndex, RandomChoice
from pdserve.router.placement.registry import build_policy
from pdserve.router.placement.profiles import save_profile
from tests.router.network_fixtures import PROFILE


def w(worker_id: str, role: str, **kw) -> WorkerSnapshot:
    return WorkerSnapshot(worker_id=worker_id, role=role, **kw)  # type: ignore[arg-type]


def req(tokens: tuple[int, ...] = (), n: int = 100, **kw) -> RequestInfo:
    return RequestInfo("r", num_prompt_tokens=len(tokens) or n, max_tokens=8, prompt_token_ids=tokens, **kw)


POOL = ClusterSnapshot(tuple(w(f"p{i}", "prefill") for i in range(4)) + tuple(w(f"d{i}", "decode") for i in range(4)))


def test_registry_has_every_policy():
    assert set(POLICIES) == {"round-robin", "least-loaded", "random", "power-of-two", "prefix-aware", "network-aware"}


def decisions(policy, snapshot: ClusterSnapshot = POOL, n: int = 20) -> list[Decision]:
    return [policy.place(req(), snapshot) for _ in range(n)]


def test_random_is_seeded_and_reproducible():
    first = decisions(RandomChoice(seed=7))
    assert first == decisions(RandomChoice(seed=7)) and first != decisions(RandomChoice(seed=8))
    assert len({d.prefill for d in first}) > 1 and len({d.decode for d in first}) > 1
    assert all(d.kind == "disaggregated" for d in first)


def test_power_of_two_is_seeded_and_picks_the_less_loaded_of_two():
    loaded = ClusterSnapshot((w("p0", "prefill", num_running=5), w("p1", "prefill", num_running=1),
                              w("d0", "decode", num_running=9), w("d1", "decode", num_running=0)))
    # with two workers per pool both are drawn: always the less loaded
    assert {d.workers for s in range(5) for d in decisions(PowerOfTwo(seed=s), loaded, 3)} == {("p1", "d1")}
    first = decisions(PowerOfTwo(seed=3))
    assert first == decisions(PowerOfTwo(seed=3)) and first != decisions(PowerOfTwo(seed=4))


def test_prefix_aware_sends_shared_prefixes_to_the_same_prefill_worker():
    policy = PrefixAware(block_size=4, max_prefix_blocks=2)
    system = (1, 2, 3, 4, 5, 6, 7, 8)
    first = policy.place(req(system + (10, 11, 12, 13)), POOL)
    assert first == Decision("disaggregated", "p0", "d0", "prefix-aware pair")
    # load moves the least-loaded choice elsewhere; the shared prefix still goes to p0
    busy = ClusterSnapshot(tuple(w(x.worker_id, x.role, num_running=1 if x.worker_id == "p0" else 0)
                                 for x in POOL.workers))
    for tail in ((20, 21, 22, 23), (30,), (40, 41, 42, 43, 44)):
        assert policy.place(req(system + tail), busy).prefill == "p0"
    assert policy.place(req((9, 9, 9, 9, 9)), busy).prefill == "p1"  # another prefix: least loaded
    assert policy.place(req((1, 2, 3)), busy).prefill == "p1"  # shorter than a block: no prefix
    assert policy.place(req((9, 9, 9, 9, 1)), busy).prefill == "p1"  # same first block as the 9s


def test_prefix_aware_gives_up_an_overloaded_owner():
    policy = PrefixAware(block_size=4, max_imbalance=2)
    prompt = tuple(range(16))
    assert policy.place(req(prompt), POOL).prefill == "p0"
    hot = ClusterSnapshot(tuple(w(x.worker_id, x.role, num_running=3 if x.worker_id == "p0" else 0)
                                for x in POOL.workers))
    assert policy.place(req(prompt), hot).prefill == "p1"


def test_prefix_index_is_bounded_and_longest_wins():
    index = PrefixIndex(block_size=2, max_blocks=3, capacity=4)
    index.record(index.keys([1, 2, 3, 4, 5, 6]), "a")
    index.record(index.keys([1, 2, 9, 9]), "b")
    assert len(index) == 4  # the oldest key was evicted
    assert index.longest(index.keys([1, 2, 3, 4, 7, 7]), {"a", "b"}) == ("a", 2)
    assert index.longest(index.keys([1, 2, 8, 8]), {"a", "b"}) == ("b", 1)
    assert index.matched_blocks(index.keys([5, 5]), "a") == 0


def test_build_policy(tmp_path):
    profile_path = tmp_path / "profile.json"
    save_profile(PROFILE, str(profile_path))
    topo_path = tmp_path / "topo.yaml"
    topo_path.write_text("workers: {p0: a}\nlinks:\n  - {between: [a, b], gbps: 100}\n")
    policy = build_policy("network-aware", topology_path=str(topo_path), profile_path=str(profile_path),
                          slo_ttft=1.0, slo_tpot=0.1, admission_control=True)
    assert isinstance(policy, NetworkAware) and policy.profile == PROFILE
    assert (policy.slo_ttft, policy.slo_tpot, policy.admission_control) == (1.0, 0.1, True)
    assert policy.topology is not None and policy.topology.link("a", "b").capacity_gbps == 100.0
    rr = build_policy("round-robin", topology_path=str(topo_path))
    assert rr.topology is not None and rr.topology.workers["p0"] == "a"
    assert isinstance(build_policy("random", seed=5), RandomChoice) and build_policy("random", seed=5).seed == 5
    assert build_policy("least-loaded").topology is None


def test_build_policy_errors(tmp_path):
    with pytest.raises(ValueError, match=r"--policy: unknown placement policy 'nope'"):
        build_policy("nope")
    with pytest.raises(ValueError, match=r"--profile: network-aware needs --profile"):
        build_policy("network-aware")
    with pytest.raises(ValueError, match=r"--profile: only the network-aware policy uses it, not 'random'"):
        build_policy("random", profile_path="x.json")
    with pytest.raises(ValueError, match=r"--slo-ttft: only the network-aware"):
        build_policy("least-loaded", slo_ttft=1.0)
    with pytest.raises(ValueError, match=r"missing.json: cannot read the profile"):
        build_policy("network-aware", profile_path=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"t.yaml: cannot read the topology file"):
        build_policy("round-robin", topology_path=str(tmp_path / "t.yaml"))
