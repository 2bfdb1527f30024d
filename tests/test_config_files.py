"""Every YAML file of the repository loads through its reader (all of them through yamlconfig),
and the shared reader's errors name the file, the line and the key."""

from __future__ import annotations

import os

import pytest

from pdserve.loadgen import yamlconfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {".git", ".venv", "node_modules", "results", "__pycache__", "build", "dist"}
# other tools' formats (Kubernetes, KubeRay, Ray autoscaler, Prometheus, Grafana): not ours to read
THIRD_PARTY = ("deploy/",)


def _load_spec(path):
    from pdserve.loadgen.spec import load_spec

    return load_spec(path)


def _load_emulation(path):
    from pdserve.launcher.emulation.spec import load_topology

    return load_topology(path)


def _load_sim_cluster(path):
    from pdserve.sim.config import load_cluster

    return load_cluster(path)


# path (relative to the repository) -> its reader; a new YAML file must be listed here
READERS = {
    "experiments/headline-topology.yaml": _load_emulation,
    "experiments/soak-1p1d.yaml": _load_emulation,
    "pdserve/launcher/emulation/examples/2p2d.yaml": _load_emulation,
    "experiments/sim/headline-cluster.yaml": _load_sim_cluster,
    **{f"experiments/{name}.yaml": _load_spec
       for name in ("gpu-grid-cpu", "gpu-grid-smoke", "gpu-grid", "headline-sweep", "headline",
                    "two-gpu/one-gpu", "two-gpu/spec", "two-gpu/steady")},
    **{f"pdserve/loadgen/examples/{name}.yaml": _load_spec
       for name in ("emulated-links", "headline", "running-server", "trace-replay")},
}


def yaml_files() -> list[str]:
    found = []
    for directory, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        for name in files:
            if name.endswith((".yaml", ".yml")):
                rel = os.path.relpath(os.path.join(directory, name), REPO).replace(os.sep, "/")
                if not rel.startswith(THIRD_PARTY):
                    found.append(rel)
    return sorted(found)


def test_every_yaml_file_has_a_reader():
    assert yaml_files() == sorted(READERS)


@pytest.mark.parametrize("rel", sorted(READERS))
def test_yaml_file_loads_through_its_reader(rel):
    assert READERS[rel](os.path.join(REPO, rel)) is not None


class _Inner(yamlconfig.Schema):
    gbps: yamlconfig.number(gt=0)


class _Outer(yamlconfig.Schema):
    name: yamlconfig.name()
    links: list[_Inner] = []


@pytest.mark.parametrize("text, line, field, message", [
    ("name: a\nlinks:\n  - {gbps: 1}\n  - {gbps: 0}\n", 4, "links[1].gbps", "must be > 0, got 0"),
    ("name: a\ncolour: red\n", 2, "colour", "unknown key; expected one of: name, links"),
    ("links: []\n", 1, "name", "required"),
    ("name: a\nname: b\n", 2, "name", "given twice"),
    ("name: 3\n", 1, "name", "expected a non-empty string, got 3"),
    ("name: a\nlinks:\n  - {gbps: '1'}\n", 3, "links[0].gbps", "expected a number, got '1'"),
])
def test_reader_errors_name_file_line_and_key(tmp_path, text, line, field, message):
    path = tmp_path / "f.yaml"
    path.write_text(text)
    with pytest.raises(yamlconfig.ConfigError) as info:
        yamlconfig.load(path, _Outer)
    err = info.value
    assert (err.path, err.line, err.field) == (str(path), line, field), str(err)
    assert str(err) == f"{path}:{line}: field '{field}': {message}"


def test_reader_unreadable_and_invalid(tmp_path):
    with pytest.raises(yamlconfig.ConfigError, match=r"nope.yaml: cannot read"):
        yamlconfig.load(tmp_path / "nope.yaml", _Outer)
    (tmp_path / "bad.yaml").write_text("name: [a\n")
    with pytest.raises(yamlconfig.ConfigError, match=r"bad.yaml:2: invalid YAML"):
        yamlconfig.load(tmp_path / "bad.yaml", _Outer)
