"""pdserve.launcher.paced (link rates per pair, pacing files, topology, router flags) and the GPU
sampler's parsers, without starting workers."""

import argparse
import json
import os
from pathlib import Path

import pytest

from pdserve.kvtransfer.pacing_spec import parse_pacing, read_pacing_file
from pdserve.launcher.gpu_sampler import GpuSampler, parse_pmon, parse_query_gpu
from pdserve.launcher.paced import (
    PacedError,
    apply_links,
    link_rates,
    parse_pairs,
    pacing_text,
    plan_workers,
    router_argv,
    worker_spec,
)
from pdserve.launcher.workers import worker_argv
from pdserve.router.placement.topology import load_topology

CLUSTER = {"model": "random:tiny-llama", "token_file": "token", "workers": [
    {"id": "p0", "role": "prefill", "grpc": "127.0.0.1:5001", "pacing_file": "pacing-p0.txt"},
    {"id": "p1", "role": "prefill", "grpc": "127.0.0.1:5002", "pacing_file": "pacing-p1.txt"},
    {"id": "d0", "role": "decode", "grpc": "127.0.0.1:5003", "kv": "ucx://127.0.0.1:6003"},
    {"id": "d1", "role": "decode", "grpc": "127.0.0.1:5004", "kv": "ucx://127.0.0.1:6004"},
]}


def test_plan_puts_pair_i_on_gpu_i_mod_n():
    plan = plan_workers(2, 2, ["0", "1"])
    assert [(w["id"], w["role"], w["gpu"], w["visible_devices"], w["device"]) for w in plan] == [
        ("p0", "prefill", "0", "0,1", "cuda:0"), ("p1", "prefill", "1", "0,1", "cuda:1"),
        ("d0", "decode", "0", "0,1", "cuda:0"), ("d1", "decode", "1", "0,1", "cuda:1")]
    argv = worker_argv(worker_spec(plan[3], "m", 5000, Path("/state"), ["--gpu-memory-fraction", "0.3"]))
    assert argv[argv.index("--device") + 1] == "cuda:1"
    assert "--device" not in worker_argv(worker_spec(plan[3], "m", 5000, Path("/s"), ["--device", "cpu"]))[:-2]
    assert {w["gpu"] for w in plan_workers(2, 2, ["0"])} == {"0"}
    assert {w["gpu"] for w in plan_workers(1, 1, [])} == {None}
    assert {w["visible_devices"] for w in plan_workers(1, 1, [])} == {None}
    with pytest.raises(PacedError, match="at least one prefill"):
        plan_workers(0, 2, [])


def test_heterogeneous_rates_pacing_files_and_topology(tmp_path):
    rates = link_rates(CLUSTER, 10, parse_pairs(["p1:d1"], CLUSTER), 0.1)
    assert rates == {"p0->d0": 10, "p0->d1": 10, "p1->d0": 10, "p1->d1": pytest.approx(1.0)}
    topology = apply_links(tmp_path, CLUSTER, rates, {"policy": "round-robin", "bandwidth_gbps": 10})
    p1 = read_pacing_file(str(tmp_path / "pacing-p1.txt"))
    assert p1.links == (("ucx://127.0.0.1:6003", 10.0), ("ucx://127.0.0.1:6004", 1.0)) and p1.default_gbps is None
    topo = load_topology(str(topology))
    assert topo.node_of("p1") == "p1" and topo.link("p1", "d1").capacity_gbps == pytest.approx(1.0)
    assert topo.link("p0", "d1").capacity_gbps == 10
    rates100 = link_rates(CLUSTER, 100, set(), 0.1)
    apply_links(tmp_path, CLUSTER, rates100, {"policy": "least-loaded", "bandwidth_gbps": 100})
    history = [json.loads(line) for line in (tmp_path / "links.jsonl").read_text().splitlines()]
    assert [h["bandwidth_gbps"] for h in history] == [10, 100] and history[1]["links"]["p1->d1"] == 100


@pytest.mark.parametrize("pairs, message", [(["p1-d1"], "PREFILL_ID:DECODE_ID"), (["d1:p1"], "PREFILL_ID"),
                                            (["p7:d1"], "p0 \\(prefill\\)")])
def test_bad_slow_pairs_are_named(pairs, message):
    with pytest.raises(PacedError, match=message):
        parse_pairs(pairs, CLUSTER)


@pytest.mark.parametrize("bandwidth, factor, message", [(0, 0.1, "--bandwidth"), (10, 0, "--slow-factor"),
                                                        (10, 2, "--slow-factor")])
def test_bad_rates_are_named(bandwidth, factor, message):
    with pytest.raises(PacedError, match=message):
        link_rates(CLUSTER, bandwidth, set(), factor)


def _args(policy, **kw):
    base = dict(policy=policy, host="127.0.0.1", port=8123, kv_deadline_s=10.0, log_level="WARNING",
                profile=None, slo_ttft=None, slo_tpot=None, kv_wire_precision="auto", no_local_prefill=False)
    return argparse.Namespace(**(base | kw))


def test_router_flags_profile_only_for_network_aware(tmp_path):
    argv = router_argv(CLUSTER, _args("round-robin", profile="prof.json", slo_ttft=1.0), tmp_path / "t.yaml")
    assert "--profile" not in argv and "--slo-ttft" not in argv
    assert "prefill#p1@p1=127.0.0.1:5002" in argv and argv[argv.index("--policy") + 1] == "round-robin"
    argv = router_argv(CLUSTER, _args("network-aware", profile="prof.json", slo_ttft=1.0, slo_tpot=0.05),
                       tmp_path / "t.yaml")
    assert argv[argv.index("--profile") + 1] == "prof.json" and argv[argv.index("--slo-tpot") + 1] == "0.05"
    assert argv[argv.index("--kv-wire-precision") + 1] == "auto"
    argv = router_argv(CLUSTER, _args("network-aware", profile="prof.json", kv_wire_precision="full"),
                       tmp_path / "t.yaml")
    assert argv[argv.index("--kv-wire-precision") + 1] == "full" and "--no-local-prefill" not in argv
    argv = router_argv(CLUSTER, _args("network-aware", profile="prof.json", no_local_prefill=True), tmp_path / "t.yaml")
    assert "--no-local-prefill" in argv
    with pytest.raises(PacedError, match="--profile"):
        router_argv(CLUSTER, _args("network-aware"), tmp_path / "t.yaml")


def test_gpu_sampler_parsers_and_missing_smi(tmp_path):
    assert parse_query_gpu("0, 87, 40960\n1, [N/A], 1024\n") == [
        {"source": "gpu", "gpu": 0, "sm_pct": 87.0, "mem_used_mib": 40960.0},
        {"source": "gpu", "gpu": 1, "sm_pct": None, "mem_used_mib": 1024.0}]
    pmon = ("# gpu        pid  type    sm    mem    enc    dec    command\n"
            "# Idx          #   C/G     %      %      %      %    name\n"
            "    0      4242     C    61     20      -      -    python3\n"
            "    1         -     -     -      -      -      -    -\n")
    assert parse_pmon(pmon) == [{"source": "process", "gpu": 0, "pid": 4242, "sm_pct": 61.0, "mem_pct": 20.0}]
    sampler = GpuSampler(tmp_path / "gpu.csv", {4242: "p0"}, smi=None)
    sampler.smi = None
    sampler.start()
    sampler.stop()
    assert not sampler.available and (tmp_path / "gpu.csv").read_text().startswith("time_unix,source")
    with pytest.raises(ValueError, match="interval_s"):
        GpuSampler(tmp_path / "g.csv", {}, interval_s=0)


def test_router_gets_the_saved_tokenizer(tmp_path):
    argv = router_argv(CLUSTER | {"tokenizer": "tokenizer"}, _args("round-robin", state=str(tmp_path)),
                       tmp_path / "t.yaml")
    assert argv[argv.index("--tokenizer") + 1] == str(tmp_path / "tokenizer")
    assert "--tokenizer" not in router_argv(CLUSTER, _args("round-robin"), tmp_path / "t.yaml")


def test_router_refuses_a_dead_cluster(tmp_path):
    import subprocess
    import sys

    from pdserve.launcher.paced import check_alive

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    cluster = {"workers": [{"id": "p0", "pid": os.getpid()}, {"id": "d0", "pid": gone.pid}]}
    with pytest.raises(PacedError, match="d0 not running"):
        check_alive(cluster, tmp_path)
    check_alive({"workers": [{"id": "p0", "pid": os.getpid()}]}, tmp_path)


def test_pacing_text_drops_the_kv_address_incarnation():
    """A decode worker's KV address with its incarnation (`#id`) is paced by HOST:PORT: the
    pacing spec does not take `#`, and the pacer matches an address's base."""
    cluster = {"workers": [{"id": "p0", "role": "prefill", "kv": "ucx://127.0.0.1:6001#aa"},
                           {"id": "d0", "role": "decode", "kv": "ucx://127.0.0.1:6003#adc88dcb"}]}
    text = pacing_text(cluster, "p0", {"p0->d0": 2.5})
    assert text == "ucx://127.0.0.1:6003=2.5"
    assert parse_pacing(text).links == (("ucx://127.0.0.1:6003", 2.5),)
    nixl = {"workers": [{"id": "p0", "role": "prefill", "kv": "nixl://127.0.0.1:6001/pdserve-recv-1-aa"},
                        {"id": "d0", "role": "decode", "kv": "nixl://127.0.0.1:6003/pdserve-recv-2-bb"}]}
    assert pacing_text(nixl, "p0", {"p0->d0": 1}) == "nixl://127.0.0.1:6003=1"  # the agent's name goes too
