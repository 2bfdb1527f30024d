"""Topology spec: parsing, and errors that name file, line and field."""

import textwrap

import pytest

from pdserve.launcher.emulation import EmulationSpecError, LinkSpec
from pdserve.launcher.emulation.cluster import topology_document
from pdserve.launcher.emulation.spec import load_topology

GOOD = """\
name: two
model: random:smollm2-135m
worker_args: [--kv-cache-gib, 0.05]
workers:
  - {id: p0, role: prefill, node: n0}
  - {id: d0, role: decode, node: n1}
topology:
  nodes: [n0, n1, n2]
  links:
    - {between: [n1, n0], gbps: 5, latency_ms: 0.2}
  defaults: {remote_gbps: 1, remote_latency_ms: 0}
router: {port: 9000, policy: least-loaded}
"""


def _write(tmp_path, text):
    path = tmp_path / "topo.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_good_spec(tmp_path):
    spec = load_topology(_write(tmp_path, GOOD))
    assert spec.nodes == ("n0", "n1", "n2") and spec.worker_args == ("--kv-cache-gib", "0.05")
    assert spec.link("n0", "n1") == LinkSpec(5, 0.2) and spec.link("n2", "n0") == LinkSpec(1)
    assert len(spec.all_links()) == 3 and spec.router.port == 9000
    assert spec.with_rate(25).link("n0", "n1") == LinkSpec(25, 0.2)


def test_topology_for_the_router_loads_with_its_loader(tmp_path):
    import yaml

    topology = pytest.importorskip("pdserve.router.placement.topology")
    spec = load_topology(_write(tmp_path, GOOD))
    out = tmp_path / "router-topology.yaml"
    out.write_text(yaml.safe_dump(topology_document(spec)))
    loaded = topology.load_topology(str(out))
    assert {(link.src, link.dst, link.capacity_gbps) for link in loaded.links} == {("n0", "n1", 5.0), ("n1", "n0", 5.0)}
    assert loaded.remote_gbps == 1.0 and dict(loaded.workers) == {"p0": "n0", "d0": "n1"}


@pytest.mark.parametrize("old, new, line, field, message", [
    ("gbps: 5,", "gbps: -5,", 10, "topology.links[0].gbps", "must be > 0"),
    ("gbps: 5,", "gbps: fast,", 10, "topology.links[0].gbps", "expected a number"),
    ("[n1, n0]", "[n1, n7]", 10, "topology.links[0].between[1]", "unknown node 'n7'"),
    ("between: [n1, n0]", "from: n1, to: n0", 10, "topology.links[0]", "give between"),
    ("role: decode", "role: dekode", 6, "workers[1].role", "expected one of"),
    ("node: n1}", "node: nX}", 6, "workers[1].node", "unknown node"),
    ("router: {port: 9000", "router: {port: 99999", 12, "router.port", "1..65535"),
    ("{remote_gbps: 1,", "{remote_gbps: 1, rate: 2,", 11, "topology.defaults.rate", "unknown key"),
    ("name: two", "name: two\ncolor: blue", 2, "color", "unknown key"),
    ("  - {id: d0, role: decode, node: n1}\n", "", 5, "workers", "at least one prefill and one decode"),
    ("[n1, n0]", "[n1, n1]", 10, "topology.links[0]", "two different nodes"),
    ("nodes: [n0, n1, n2]", "nodes: [n0, n1, n0]", 8, "topology.nodes[2]", "listed twice"),
])
def test_errors_name_file_line_and_field(tmp_path, old, new, line, field, message):
    assert old in GOOD
    path = _write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(EmulationSpecError) as info:
        load_topology(path)
    err = info.value
    assert (err.path, err.line, err.field) == (str(path), line, field), str(err)
    assert message in str(err) and str(err).startswith(f"{path}:{line}: field '{field}'")


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(EmulationSpecError, match="cannot read"):
        load_topology(tmp_path / "nope.yaml")
    with pytest.raises(EmulationSpecError, match=r"topo.yaml:3: invalid YAML"):
        load_topology(_write(tmp_path, "model: x\ntopology: {nodes: [a\n"))
    with pytest.raises(EmulationSpecError, match="field 'topology': required"):
        load_topology(_write(tmp_path, "model: x\nworkers: []\n"))


def test_router_policy_args_go_to_that_policy_only(tmp_path):
    text = GOOD.replace("router: {port: 9000, policy: least-loaded}",
                        "router:\n  args: [--kv-deadline-s, 5]\n"
                        "  policy_args: {network-aware: [--profile, p.json, --slo-ttft, 1.5]}")
    router = load_topology(_write(tmp_path, text)).router
    assert router.args_for("network-aware") == ("--kv-deadline-s", "5", "--profile", "p.json", "--slo-ttft", "1.5")
    assert router.args_for("round-robin") == ("--kv-deadline-s", "5")


def test_router_policy_args_must_be_lists(tmp_path):
    text = GOOD.replace("router: {port: 9000, policy: least-loaded}",
                        "router:\n  policy_args: {network-aware: --profile}")
    with pytest.raises(EmulationSpecError, match="router.policy_args.network-aware"):
        load_topology(_write(tmp_path, text))


def test_router_log_level_is_checked(tmp_path):
    text = GOOD.replace("router: {port: 9000, policy: least-loaded}", "router: {log_level: debug}")
    assert load_topology(_write(tmp_path, text)).router.log_level == "DEBUG"
    with pytest.raises(EmulationSpecError, match="router.log_level"):
        load_topology(_write(tmp_path, text.replace("debug", "loud")))
