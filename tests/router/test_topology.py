"""Topology YAML: links, defaults, and errors that name the file, line and field."""

from __future__ import annotations

import pytest

from pdserve.router.placement.topology import Link, Topology, load_topology, parse_topology

GOOD = """\
defaults:
  local_gbps: 400
  remote_gbps: 25
  remote_latency_ms: 0.2
nodes: [a]
workers:
  prefill-0: a
  decode-0: b
links:
  - between: [a, b]
    gbps: 100
    latency_ms: 0.01
  - from: a
    to: c
    gbps: 1
"""


def test_parse_links_workers_and_defaults(tmp_path):
    path = tmp_path / "topo.yaml"
    path.write_text(GOOD)
    topo = load_topology(str(path))
    assert topo.nodes == ("a", "b", "c")
    assert dict(topo.workers) == {"prefill-0": "a", "decode-0": "b"}
    assert topo.link("a", "b") == Link("a", "b", 100.0, 0.01)
    assert topo.link("b", "a") == Link("b", "a", 100.0, 0.01)  # between: symmetric
    assert topo.link("a", "c") == Link("a", "c", 1.0, 0.2)  # from/to: one way, default latency
    assert topo.link("c", "a") == Link("c", "a", 25.0, 0.2)  # no entry: the remote default
    assert topo.link("b", "b") == Link("b", "b", 400.0, 0.005)  # same node: the local default
    assert topo.link("a", "b").key == "a->b"


def test_node_of_prefers_the_file_then_the_worker_then_its_id():
    topo = parse_topology(GOOD)
    assert topo.node_of("prefill-0", "elsewhere") == "a"
    assert topo.node_of("decode-9", "n7") == "n7"
    assert topo.node_of("decode-9") == "decode-9"  # unplaced: its own node, never a local link by accident
    assert Topology().link("x", "y").capacity_gbps == 10.0 and Topology().link("x", "x").capacity_gbps == 200.0


def test_empty_file_is_all_defaults():
    assert parse_topology("") == Topology()


@pytest.mark.parametrize("text, match", [
    ("colour: red\n", r"topo.yaml:1: field 'colour': unknown key"),
    ("defaults:\n  local_gbps: 100\n  remote_gpbs: 5\n", r"topo.yaml:3: field 'defaults.remote_gpbs': unknown key"),
    ("defaults:\n  remote_gbps: -1\n", r"topo.yaml:2: field 'defaults.remote_gbps': must be > 0, got -1"),
    ("links:\n  - between: [a, b]\n    gbps: fast\n",
     r"topo.yaml:3: field 'links\[0\].gbps': expected a number, got 'fast'"),
    ("links:\n  - between: [a, b]\n", r"topo.yaml:2: field 'links\[0\].gbps': required"),
    ("links:\n  - between: [a, b, c]\n    gbps: 1\n",
     r"topo.yaml:2: field 'links\[0\].between': must name 2 nodes, got 3"),
    ("links:\n  - from: a\n    gbps: 1\n", r"topo.yaml:2: field 'links\[0\]': needs between"),
    ("links:\n  - between: [a, b]\n    gbps: 1\n    latency_ms: -2\n",
     r"topo.yaml:4: field 'links\[0\].latency_ms': must be >= 0"),
    ("workers:\n  p0: [a]\n", r"topo.yaml:2: field 'workers.p0': expected a non-empty string"),
    ("links: {a: b}\n", r"topo.yaml:1: field 'links': expected a list"),
    ("links:\n  - {between: [a, b], gbps: 1}\n  - {from: a, to: b, gbps: 2}\n",
     r"topo.yaml:2: field 'links': link a->b is given twice"),
    ("links:\n  - {between: [a, b], gbps: 1, gbps: 2}\n", r"topo.yaml:2: field 'links\[0\].gbps': given twice"),
    ("links: [\n", r"topo.yaml:2: invalid YAML"),
])
def test_errors_name_file_line_and_field(text, match):
    with pytest.raises(ValueError, match=match):
        parse_topology(text, "topo.yaml")


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope.yaml: cannot read the topology file"):
        load_topology(str(tmp_path / "nope.yaml"))
